"""Shared fixtures: every test starts from the same random seed; tests can run with and without the C loops."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _trust_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The command line's per-user trust record (``fxquant prepare`` writes it) goes to a temporary file: tests
    never touch the real ``~/.local/state/fxquant``. Subprocesses inherit the variable."""
    path = tmp_path_factory.mktemp("state") / "trusted-runs.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FXQUANT_TRUST_FILE", str(path))
        yield path


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["c_loops", "torch"])
def native_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with fxquant's C loops and without them: the torch paths an install without a compiler takes.

    Modules use it for every test with ``pytestmark = pytest.mark.usefixtures("native_loops")``.
    """
    from fxquant import native

    if request.param == "torch":
        monkeypatch.setattr(native, "loops", None)
    return str(request.param)


@pytest.fixture(params=["direct", "torch_ops"])
def onednn_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the onednn backend's layers on oneDNN primitives fxquant builds itself (the ``onednn`` extra,
    which the test extra installs on x86-64 Linux) and on the torch ops that install falls back to without it.

    Modules use it with ``pytestmark = pytest.mark.usefixtures("onednn_path")``.
    """
    import platform

    from fxquant.kernels.onednn import direct as onednn_direct

    if request.param == "torch_ops":
        monkeypatch.setattr(onednn_direct, "available", lambda: False)
    elif platform.system() == "Linux" and platform.machine() == "x86_64":
        assert onednn_direct.available(), f"{onednn_direct.status()}: pip install -e '.[test]' installs oneDNN"
    else:
        pytest.skip("Intel's oneDNN wheel is for x86-64 Linux")
    return str(request.param)

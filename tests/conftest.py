"""Shared fixtures: every test starts from the same random seed; tests can run with and without the C loops."""

from __future__ import annotations

import pytest
import torch


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

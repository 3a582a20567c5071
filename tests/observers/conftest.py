"""Observer tests run single-threaded."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """Histograms are small tensors: on a busy machine OpenMP's thread hand-offs cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["native", "torch"])
def counting_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on both counting paths: the C loop and the pure-torch one used without a compiler.

    Modules about histograms use it for every test (``pytestmark = pytest.mark.usefixtures("counting_path")``).
    """
    from fxquant.observers import counting

    if request.param == "torch":
        monkeypatch.setattr(counting, "_native", None)
    return str(request.param)

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

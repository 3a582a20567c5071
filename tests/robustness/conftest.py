"""Hypothesis profiles for the robustness tests, and one thread per test.

``robustness`` (the default) runs a bounded number of examples per property so the suite takes minutes;
``HYPOTHESIS_PROFILE=thorough python -m pytest tests/robustness`` runs thousands (see docs/robustness.md).
The tests read the profile through ``strategies.profile()``; the ``thorough`` profile is also loaded as the
session default when asked for, so it can only make other property tests run longer, never shorter.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the tests import strategies / spec_model by name

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
# The default run draws the same examples on every machine and clone (derandomized: a fresh clone has no example
# database, so random draws made CI a lottery); the thorough profile explores, and prints a blob for what it finds.
settings.register_profile("robustness", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK,
                          print_blob=True, derandomize=True)
settings.register_profile("thorough", max_examples=2000, deadline=None, suppress_health_check=_SLOW_OK,
                          print_blob=True)
if os.environ.get("HYPOTHESIS_PROFILE") == "thorough":
    settings.load_profile("thorough")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Small models on a shared machine: OpenMP hand-offs between threads cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

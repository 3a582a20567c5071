"""Shared pieces of the report tests: the digits CNN trained, quantized and reported on once per test process.

A module with a unique name rather than a ``conftest.py``: test directories here have no ``__init__.py``, so every
``conftest.py`` is imported as the module ``conftest`` and a second one would shadow the helpers other directories
import from the root one. ``functools.cache`` gives session-wide reuse without fixtures.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import fx, nn

import fxquant
from fxquant.models.digits import digits_loader, train_digits_cnn
from fxquant.report.latency import num_threads
from fxquant.report.schema import Report

FAST: dict[str, Any] = {"threads": 1, "latency_budget_s": 0.3, "progress": False, "layer_batches": 2}

# The example of shared/API.md, completed with numbers: a report from another producer with only the fixed keys.
API_EXAMPLE: dict[str, Any] = {
    "schema_version": 1, "backend": "fbgemm", "observer": "histogram",
    "accuracy": {"metric": "top1", "float": 0.981, "quantized": 0.978, "drop": 0.003},
    "latency_ms": {"float": {"median": 2.0, "p90": 2.2}, "quantized": {"median": 1.0, "p90": 1.1}, "speedup": 2.0},
    "size_bytes": {"float": 4000, "quantized": 1000},
    "layers": [{"name": "features.0", "quantized": True, "sqnr_db": 31.2},
               {"name": "head", "quantized": False, "reason": "excluded by config"}],
}


@functools.cache
def digits_model() -> nn.Module:
    """The trained digits CNN (shared: do not modify it)."""
    with num_threads(1):  # a shared 2-core machine trains this tiny CNN faster on one thread
        return train_digits_cnn(epochs=2)


def quantize_digits(**config: Any) -> fx.GraphModule:
    """The digits CNN quantized on its calibration split (a fresh copy each call, so tests may damage it)."""
    calib = digits_loader("calib", batch_size=64)
    example = (next(iter(calib))[0][:1],)
    return fxquant.quantize(copy.deepcopy(digits_model()), example, calib, fxquant.QuantConfig(**config),
                            progress=False)


@functools.cache
def digits_qmodel() -> fx.GraphModule:
    """The digits CNN in int8 with ``fc2`` left float (shared: do not modify it)."""
    return quantize_digits(exclude=["fc2"])


@functools.cache
def digits_report() -> Report:
    """The report of :func:`digits_qmodel` on the test split, timed at batch sizes 1 and 8."""
    with torch.random.fork_rng():
        return fxquant.report(digits_model(), digits_qmodel(), digits_loader("test", batch_size=64),
                              batch_sizes=[1, 8], **FAST)

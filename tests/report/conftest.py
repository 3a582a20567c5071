"""Shared, session-scoped report fixtures: the digits CNN is trained and reported on once for the whole directory."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxquant
from fxquant.models.digits import digits_loader, train_digits_cnn
from fxquant.report.latency import num_threads
from fxquant.report.schema import Report

FAST = {"threads": 1, "latency_budget_s": 0.3, "progress": False, "layer_batches": 2}


@pytest.fixture(scope="session")
def digits_model() -> nn.Module:
    with num_threads(1):  # a shared 2-core machine trains this tiny CNN faster on one thread
        return train_digits_cnn(epochs=2)


def quantize_digits(model: nn.Module, **config: Any) -> fx.GraphModule:
    """The digits CNN quantized on its calibration split (a fresh copy each call, so tests may damage it)."""
    calib = digits_loader("calib", batch_size=64)
    example = (next(iter(calib))[0][:1],)
    return fxquant.quantize(copy.deepcopy(model), example, calib, fxquant.QuantConfig(**config), progress=False)


@pytest.fixture(scope="session")
def digits_qmodel(digits_model: nn.Module) -> fx.GraphModule:
    return quantize_digits(digits_model, exclude=["fc2"])


@pytest.fixture(scope="session")
def digits_report(digits_model: nn.Module, digits_qmodel: fx.GraphModule) -> Report:
    with torch.random.fork_rng():
        return fxquant.report(digits_model, digits_qmodel, digits_loader("test", batch_size=64), batch_sizes=[1, 8],
                              **FAST)

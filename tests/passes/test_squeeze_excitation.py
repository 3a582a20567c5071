"""Squeeze-excitation ``x * sigmoid(fc2(act(fc1(pool(x)))))``: the gate and the product stay int8.

insert_observers quantizes ``x`` once for both the pool and the multiply (the pool then runs int8), the sigmoid gets
its fixed output qparams (no observer), and lowering turns it into ``QuantizedFixedRange`` and the product into
``QuantizedMul``. Counts are against hand-counted boundaries; the INT8 output is checked against the fake-quant
simulation on every backend.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.nn.fixed_range import QuantizedFixedRange
from fxquant.nn.quantized import QuantizedMul, QuantizedPool
from fxquant.observers import Observer
from fxquant.testing import assert_sqnr, simulate


class _SE(nn.Module):
    """conv -> SiLU (float) -> squeeze-excitation gate -> multiply -> conv; ``gate``: "sigmoid" module, "torch"
    function, "method", "hardsigmoid" or "tanh"."""

    def __init__(self, gate: str = "sigmoid") -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.act = nn.SiLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.project = nn.Conv2d(16, 8, 1)
        self.gate = gate
        self.sigmoid = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv(x))
        s = self.fc2(torch.relu(self.fc1(self.pool(x))))
        if self.gate == "sigmoid":
            s = self.sigmoid(s)
        elif self.gate == "torch":
            s = torch.sigmoid(s)
        elif self.gate == "method":
            s = s.sigmoid()
        elif self.gate == "hardsigmoid":
            s = nn.functional.hardsigmoid(s)
        else:
            s = torch.tanh(s)
        return self.project(x * s)


def _calibrated(model: nn.Module, backend: str = "fbgemm") -> torch.fx.GraphModule:
    torch.manual_seed(0)
    data = [torch.randn(4, 3, 12, 12) for _ in range(4)]
    prepared = fxquant.prepare(model.eval(), (data[0],), fxquant.QuantConfig(backend=backend))
    fxquant.calibrate(prepared, data, progress=False)
    return prepared


def _observer_labels(gm: torch.fx.GraphModule) -> list[str]:
    modules = dict(gm.named_modules())
    observers = [modules[str(n.target)] for n in gm.graph.nodes
                 if n.op == "call_module" and isinstance(modules[str(n.target)], Observer)]
    return [o.label for o in observers if o.kind == "activation"]  # not bias correction's statistics


def test_the_silu_output_is_observed_once_for_pool_and_multiply_and_the_gate_not_at_all() -> None:
    labels = _observer_labels(_calibrated(_SE()))
    assert labels == ["x (input of conv)", "output of conv", "act (input of pool)", "output of fc1",
                      "output of fc2", "output of mul", "output of project"], labels


@pytest.mark.parametrize("gate", ["sigmoid", "torch", "method", "hardsigmoid", "tanh"])
def test_gate_and_product_lower_to_int8_with_three_boundaries(gate: str) -> None:
    qmodel = fxquant.convert(_calibrated(_SE(gate)))
    modules = [type(m) for m in qmodel.modules()]
    assert QuantizedFixedRange in modules and QuantizedMul in modules and QuantizedPool in modules
    report = fxquant.coverage(qmodel)
    # quantize: the input; dequantize: the model output (the SiLU between two int8 values is a table, nn.lookup)
    assert (report.quantize_nodes, report.dequantize_nodes) == (1, 1), str(report)


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("gate", ["sigmoid", "tanh"])
def test_int8_matches_the_simulation(backend: str, gate: str) -> None:
    prepared = _calibrated(_SE(gate), backend)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        expected = simulate(prepared, backend)(x)
        actual = fxquant.convert(prepared, backend=backend)(x)
        assert_sqnr(expected, actual, 30.0, f"{backend} {gate} SE vs simulation")
        assert_sqnr(prepared(x), actual, 15.0, f"{backend} {gate} SE vs float")

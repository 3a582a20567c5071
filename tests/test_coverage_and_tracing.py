"""Partial tracing, INT8 islands inside untraceable blocks, coverage, and torch.fx tracing options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant.errors import CalibrationError
from fxquant.kernels.registry import get_backend
from fxquant.models import create_model, example_inputs
from fxquant.nn import QuantizedConv2d, QuantizedConvTranspose2d, QuantizedLinear
from fxquant.testing import assert_sqnr


def _data() -> list[tuple[torch.Tensor]]:
    x = example_inputs("control_flow", 4)[0]
    return [(torch.randn_like(x),) for _ in range(4)]


def test_data_dependent_block_stays_float_but_its_layers_are_int8_islands() -> None:
    model = create_model("control_flow")
    data = _data()
    prepared = fxquant.prepare(model, data[0], fxquant.QuantConfig(unobserved="error"))
    fxquant.calibrate(prepared, data, progress=False)
    # gated sees post-ReLU values, so its negative branch never runs: its observers saw nothing
    with pytest.raises(CalibrationError, match=r"gated.x \(input of gated.negative\), output of gated.negative"):
        fxquant.convert(prepared)
    prepared = fxquant.prepare(model, data[0], fxquant.QuantConfig(exclude=["gated.negative"]))
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared)
    report = fxquant.coverage(qmodel)
    rows = {row.path: row for row in report.layers}
    layers = {name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert set(rows) == layers, str(report)
    assert [p for p, r in rows.items() if not r.quantized] == ["gated.negative"], str(report)
    assert isinstance(qmodel.get_submodule("gated.positive.positive"), QuantizedConv2d)
    assert len(report.graph_breaks) == 1 and "'gated'" in report.graph_breaks[0]
    assert "control_flow.py" in report.graph_breaks[0] and "if x.sum() > 0" in report.graph_breaks[0]
    assert_sqnr(model(data[0][0]), qmodel(data[0][0]), 25.0, "control_flow")


def test_coverage_reasons_for_float_layers() -> None:
    model = create_model("control_flow")
    data = _data()
    config = fxquant.QuantConfig(exclude=["fc"], partial_tracing=True, leaf_modules=["gated"])
    prepared = fxquant.prepare(model, data[0], config)
    rows = {row.path: row for row in fxquant.coverage(prepared).layers}
    assert rows["fc"].reason == "excluded by config" and not rows["fc"].quantized
    assert rows["stem"].quantized and rows["stem"].backend == fxquant.QuantConfig().backend
    assert "not called as a module" in rows["gated.positive"].reason  # inside a user leaf: float black box


def test_keep_first_and_last_float_and_type_rules() -> None:
    model = create_model("conv_bn")
    x = torch.randn(2, 3, 32, 32)
    config = fxquant.QuantConfig(keep_first_float=True, keep_last_float=True)
    rows = fxquant.coverage(fxquant.prepare(model, (x,), config)).layers
    assert [r.quantized for r in rows] == [False, False]
    assert "first layer kept float" in rows[0].reason and "last layer kept float" in rows[1].reason
    # an override (path, then type) beats the keep-first rule; a type exclusion beats include
    config = fxquant.QuantConfig(keep_first_float=True, overrides={"type:Conv2d": {"weight": "per_tensor"}},
                                 exclude=["type:Linear"])
    rows = fxquant.coverage(fxquant.prepare(model, (x,), config)).layers
    assert [r.quantized for r in rows] == [True, False]


class SameConv(nn.Conv2d):
    """A "same"-padding conv that pads, then calls F.conv2d: torch.fx traces into it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = SameConv(3, 8, 3), nn.BatchNorm2d(8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.w = nn.Parameter(torch.randn(6, 4) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bn(self.conv(x)), inplace=True)
        y = self.up(y).mean((2, 3))
        return F.linear(y, self.w)


def test_conv_subclass_functional_linear_and_transposed_conv_are_quantized() -> None:
    model = Functional().eval()
    model.bn.running_var.uniform_(0.5, 2.0)
    data = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    prepared = fxquant.prepare(model, (data[0],))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in prepared.modules())  # folded into the subclass conv
    torch.testing.assert_close(prepared(data[0]), model(data[0]), rtol=1e-4, atol=1e-4)
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared)
    kinds = [type(m) for m in qmodel.modules()]
    assert QuantizedConv2d in kinds and QuantizedConvTranspose2d in kinds and QuantizedLinear in kinds
    assert_sqnr(model(data[0]), qmodel(data[0]), 25.0, "functional model")


def test_concrete_args_and_custom_tracer() -> None:
    class Flag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
            return self.b(x) if use_b else self.a(x)

    prepared = fxquant.prepare(Flag().eval(), (torch.randn(2, 4),), concrete_args={"use_b": False})
    assert [r.path for r in fxquant.coverage(prepared).layers if r.quantized] == ["a"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class BlocksAreLeaves(torch.fx.Tracer):  # a user's own tracer: fxquant uses it as given
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, Block) or super().is_leaf_module(m, name)

    model = nn.Sequential(Block(), nn.Linear(4, 4)).eval()
    prepared = fxquant.prepare(model, (torch.randn(2, 4),), tracer_class=BlocksAreLeaves)
    rows = {r.path: r.quantized for r in fxquant.coverage(prepared).layers}
    assert rows == {"1": True, "0.inner": False}


def test_zoo_boundaries_unet_cat_stays_int8() -> None:
    model = create_model("unet")
    x = example_inputs("unet", 2)[0]
    prepared = fxquant.prepare(model, (x,))
    fxquant.calibrate(prepared, [torch.randn_like(x) for _ in range(3)], progress=False)
    report = fxquant.coverage(fxquant.convert(prepared))
    assert all(r.quantized for r in report.layers), str(report)
    float_output = get_backend(fxquant.QuantConfig().backend).fuses_float_output  # the last conv returns float
    assert report.quantize_nodes == 1 and report.dequantize_nodes == (0 if float_output else 1), str(report)

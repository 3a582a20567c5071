"""The fusions convert applies on the lowered graph (``fxquant.passes.fuse_lowered``): where they happen, where the
fused kernel must copy its in-place input, and that fused and unfused backends still agree at the output.

A reference conversion compared with onednn's takes onednn's activation ranges (7 bits without VNNI), so both models
quantize every activation alike and only the kernels differ."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn

import fxquant
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.nn.lookup import QuantizedLookup
from fxquant.nn.quantized import DeQuantize, QuantizedAdd, QuantizedConvAdd2d, QuantizedLinear
from fxquant.testing import simulate

FUSING = [n for n in ("onednn", "reference") if n in available_backends()]


class _Residual(nn.Module):
    """Three residual joins: a ResNet one (its accum read only before the add), ``h + conv(h)`` (the fused conv
    reads its own accum) and one whose accum is read again after the add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a1, self.a2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        y = torch.relu(self.a2(torch.relu(self.a1(y))) + y)
        h = self.b(y) + y
        z = torch.relu(self.c(h) + h)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(z + h, 1), 1))


def _converted(backend: str, model: nn.Module, shape: tuple[int, ...]) -> tuple[fx.GraphModule, fx.GraphModule]:
    prepared = fxquant.prepare(model.eval(), (torch.randn(shape),))
    fxquant.calibrate(prepared, [torch.randn(4, *shape[1:]) for _ in range(3)], progress=False)
    return prepared, fxquant.convert(prepared, backend=backend)


def _reference_on_the_ranges_of(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the reference backend declare ``backend``'s activation ranges for the rest of the test."""
    monkeypatch.setattr(get_backend("reference"), "activation_qrange", get_backend(backend).activation_qrange)


def _called(gm: fx.GraphModule, kind: type[nn.Module]) -> list[nn.Module]:
    return [gm.get_submodule(str(n.target)) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), kind)]


@pytest.mark.parametrize("backend", FUSING)
def test_every_conv_feeding_an_add_alone_is_fused_and_copies_its_accum_only_when_needed(backend: str) -> None:
    prepared, qmodel = _converted(backend, _Residual(), (2, 3, 9, 9))
    fused = {path: m for path, m in qmodel.named_modules() if isinstance(m, QuantizedConvAdd2d)}
    assert sorted(fused) == ["a2", "b", "c"], sorted(fused)
    assert not fused["a2"].clone_accum  # y was read by a1, before the add
    assert fused["b"].clone_accum  # b reads its own accum y inside the fused kernel
    assert fused["c"].clone_accum  # c reads h, and z + h reads h after the add
    assert len(_called(qmodel, QuantizedAdd)) == 1  # z + h: neither input is a conv's alone
    x = torch.randn(3, 3, 9, 9)
    step = float(qmodel.get_submodule("fc").out_qp.scale)
    error = float((qmodel(x) - simulate(prepared, backend)(x)).abs().max()) / step
    assert error <= 1.0 + 1e-4, f"{backend}: {error:.2f} output steps from the simulation"


def test_backends_with_the_fused_kernels_agree_within_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """One calibrated model converted per backend: the fusing ones within one output step of the reference
    backend; fbgemm/qnnpack keep their separate add (no fused module) and are checked against their simulation in
    tests/robustness (with one rounding more per residual join they can be further from the reference)."""
    torch.manual_seed(1)
    if "onednn" in available_backends():
        _reference_on_the_ranges_of("onednn", monkeypatch)
    prepared, reference = _converted("reference", _Residual(), (2, 3, 9, 9))
    x = torch.randn(3, 3, 9, 9)
    step = float(reference.get_submodule("fc").out_qp.scale)
    for backend in (b for b in ("onednn", "fbgemm", "qnnpack") if b in available_backends()):
        qmodel = fxquant.convert(prepared, backend=backend)
        assert bool(_called(qmodel, QuantizedConvAdd2d)) is (backend in FUSING)
        if backend in FUSING:
            error = float((qmodel(x) - reference(x)).abs().max()) / step
            assert error <= 1.0 + 1e-4, f"{backend}: {error:.2f} output steps from the reference backend"


class _FeedForward(nn.Module):
    """``down(f(up(x)))`` with a float function that no kernel applies (ELU), so ``up`` returns float."""

    def __init__(self, function: Any = nn.functional.elu) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.function(self.up(x)))


@pytest.mark.parametrize("backend", [b for b in ("onednn", "reference", "fbgemm") if b in available_backends()])
def test_a_linear_read_only_by_float_code_returns_float_where_the_backend_fuses_that(backend: str) -> None:
    prepared, qmodel = _converted(backend, _FeedForward(), (2, 5, 16))
    up = qmodel.get_submodule("up")
    assert isinstance(up, QuantizedLinear)
    fuses = get_backend(backend).fuses_float_output  # fbgemm too: through oneDNN's float-output kernel
    assert up.float_output is fuses and qmodel.get_submodule("down").float_output is fuses  # ELU, model output
    # unfused, the ELU between two int8 values is a table (fxquant.nn.lookup): only the model output dequantizes
    assert len(_called(qmodel, DeQuantize)) == (0 if fuses else 1)
    assert len(_called(qmodel, QuantizedLookup)) == (0 if fuses else 1)
    x = torch.randn(3, 5, 16)
    step = float(qmodel.get_submodule("down").out_qp.scale)
    error = float((qmodel(x) - simulate(prepared, backend)(x)).abs().max()) / step
    assert error <= 1.0 + 1e-4, f"{backend}: {error:.2f} output steps from the simulation"


class _ConvSiLU(nn.Module):
    """EfficientNet's pattern: conv -> SiLU -> conv, in module and in functional form."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.act, self.conv = nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.silu(self.conv(self.act(self.stem(x)))))


UNARY_MODELS = [
    ("silu", nn.SiLU()), ("silu", nn.functional.silu), ("hardswish", nn.Hardswish()),
    ("gelu", nn.GELU()), ("gelu", nn.functional.gelu), ("gelu_tanh", nn.GELU(approximate="tanh")),
]


@pytest.mark.parametrize(("unary", "function"), UNARY_MODELS)
def test_a_linear_then_silu_hardswish_or_gelu_becomes_one_call_where_the_backend_fuses_it(
        unary: str, function: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """onednn: ``up`` applies the function as its post-op and writes the next Linear's int8 input; no float
    function, dequantize or quantize stays between them. The output stays within one step of the simulation, and
    of the unfused reference backend converted from the same calibration."""
    if "onednn" not in available_backends():
        pytest.skip("onednn backend unavailable")
    torch.manual_seed(2)
    prepared, qmodel = _converted("onednn", _FeedForward(function), (2, 5, 16))
    up = qmodel.get_submodule("up")
    assert isinstance(up, QuantizedLinear) and up.unary == unary and not up.float_output
    assert [n.op for n in qmodel.graph.nodes] == ["placeholder", "call_module", "call_module", "call_module",
                                                  "output"]  # quantize, up (+ function), down
    x = torch.randn(3, 5, 16)
    step = float(qmodel.get_submodule("down").out_qp.scale)
    assert float((qmodel(x) - simulate(prepared, "onednn")(x)).abs().max()) / step <= 1.0 + 1e-4
    _reference_on_the_ranges_of("onednn", monkeypatch)
    reference = fxquant.convert(prepared, backend="reference")
    assert reference.get_submodule("up").unary is None  # nothing to gain from fusing there
    assert float((qmodel(x) - reference(x)).abs().max()) / step <= 1.0 + 1e-4


def test_conv_silu_is_fused_on_onednn_and_relowers_to_fbgemm() -> None:
    """Both SiLUs of the conv net are fused into their convs on onednn; the same calibration on fbgemm keeps the
    separate ops, and re-lowering the fused module to fbgemm (``auto`` does per layer) runs the unfused sequence."""
    if not {"onednn", "fbgemm"} <= set(available_backends()):
        pytest.skip("needs onednn and fbgemm")
    torch.manual_seed(3)
    prepared, qmodel = _converted("onednn", _ConvSiLU(), (2, 3, 10, 10))
    assert qmodel.get_submodule("stem").unary == "silu" and qmodel.get_submodule("conv").unary == "silu"
    functions = [n for n in qmodel.graph.nodes if n.op == "call_function" and n.target is nn.functional.silu]
    assert not functions and not any(isinstance(m, nn.SiLU) for m in qmodel.modules())
    x = torch.randn(3, 3, 10, 10)
    step = float(qmodel.get_submodule("head").out_qp.scale)
    fused_out = qmodel(x)
    assert float((fused_out - simulate(prepared, "onednn")(x)).abs().max()) / step <= 1.0 + 1e-4
    stem = qmodel.get_submodule("stem")
    a = stem.backend.quantize(x, stem.in_qp)
    fused_stem = stem.backend.dequantize(stem(a), stem.unary_qp)
    stem.relower(get_backend("fbgemm"))
    relowered = get_backend("fbgemm").dequantize(stem(get_backend("fbgemm").quantize(x, stem.in_qp)), stem.unary_qp)
    assert float((relowered - fused_stem).abs().max()) / float(stem.unary_qp.scale) <= 2.0 + 1e-4


class _Clamped(nn.Module):
    """Clamps applied through the output range: a hardtanh Linear read only by float code (the model output), and a
    hardtanh conv feeding a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.branch = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))
        y = nn.functional.hardtanh(self.branch(y), -0.5, 0.5) + y
        return nn.functional.hardtanh(self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1)), -0.1, 0.1)


@pytest.mark.parametrize("backend", FUSING)
def test_a_clamp_applied_by_the_output_range_is_never_fused_away(backend: str) -> None:
    """Regression: with float outputs the hardtanh Linear returned its unclamped result (10x the float model's
    output on a generated model), and a fused conv + add would skip the branch's clamp the same way."""
    torch.manual_seed(4)
    prepared, qmodel = _converted(backend, _Clamped(), (2, 3, 6, 6))
    fc, branch = qmodel.get_submodule("fc"), qmodel.get_submodule("branch")
    assert isinstance(fc, QuantizedLinear) and fc.range_clamp and not fc.float_output
    assert branch.range_clamp and not isinstance(branch, QuantizedConvAdd2d)
    x = torch.randn(5, 3, 6, 6) * 3
    with torch.no_grad():
        out = qmodel(x)
        assert float(out.abs().max()) <= 0.1 + float(fc.out_qp.scale)
        step = float(fc.out_qp.scale)
        assert float((out - simulate(prepared, backend)(x)).abs().max()) / step <= 1.0 + 1e-4

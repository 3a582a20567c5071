"""Float outputs: a Linear/Conv read only by float code returns float from its accumulator, and a residual add that
mixes in a float value and feeds only float code stays float (``fxquant.passes.float_outputs``).

Kernels are checked against the float result computed here by hand from the integers (exact in float64); graphs
by counting nodes; the bert_style encoder by its SQNR with and without the rule, and against the fake-quant model.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant.kernels.base import ConvSpec
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.models import create_model, example_inputs
from fxquant.nn import DeQuantize, Quantize, QuantizedAdd
from fxquant.observers import Observer
from fxquant.qparams import QParams, sqnr_db
from fxquant.testing import assert_sqnr, calibrated, simulate

_insert_observers = importlib.import_module("fxquant.passes.insert_observers")


def _integers(shape: tuple[int, ...], low: int, high: int) -> torch.Tensor:
    return torch.randint(low, high + 1, shape)


def _layer(out_features: int, in_shape: tuple[int, ...], in_scale: float, qmax: int) -> tuple[
        torch.Tensor, QParams, QParams, torch.Tensor]:
    """Random int8 weights with per-channel scales, input qparams on ``[0, qmax]`` (the backend's range: fbgemm
    saturates 8-bit inputs of grouped convs), and a bias on the accumulator's grid (every backend adds it unrounded
    then, whether it rounds the bias to int32 first or not)."""
    weight = _integers((out_features, *in_shape), -127, 127).to(torch.int8)
    scales = torch.rand(out_features) * 0.02 + 0.005
    w_qp = QParams(scales, torch.zeros(out_features, dtype=torch.int64), -127, 127, axis=0)
    in_qp = QParams(torch.tensor(in_scale), torch.tensor(qmax // 2 + 3), 0, qmax)
    bias = _integers((out_features,), -2000, 2000).double() * in_scale * scales.double()
    return weight, w_qp, in_qp, bias.float()


def _check(backend_name: str, got: torch.Tensor, expected: torch.Tensor, out_qp: QParams, *, exact: bool) -> None:
    assert got.dtype == torch.float32
    error = (got.double() - expected).abs().max().item()
    # unrounded: float32 rounding of the result only; the default rounds to out_qp first (fbgemm's convs and
    # qnnpack have no exact float-output kernel)
    rounded = not exact
    bound = 0.5 * float(out_qp.scale) + 1e-5 if rounded else 4e-6 * expected.abs().max().item()
    assert error <= bound, f"{backend_name}: max error {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("backend_name", available_backends())
@pytest.mark.parametrize("relu", [False, True])
def test_linear_to_float_is_the_hand_computed_accumulator(backend_name: str, relu: bool) -> None:
    backend = get_backend(backend_name)
    weight, w_qp, in_qp, bias = _layer(24, (40,), 0.03, backend.activation_qrange(feeds_grouped_conv=False)[1])
    zero_point = int(in_qp.zero_point)
    q_x = _integers((2, 5, 40), 0, in_qp.qmax)
    expected = (q_x.double() - zero_point) @ weight.double().t() * (0.03 * w_qp.scale.double()) + bias.double()
    expected = expected.clamp(min=0) if relu else expected
    out_qp = QParams(torch.tensor(float(expected.abs().max()) / 127), torch.tensor(128), 0, 255)
    a = backend.quantize((q_x.float() - zero_point) * 0.03, in_qp)  # exactly the integers q_x
    packed = backend.prepack_linear(weight, w_qp, bias)
    got = backend.linear_to_float(a, packed, in_qp, out_qp, relu=relu)
    _check(backend_name, got, expected, out_qp, exact=backend.fuses_float_output)


@pytest.mark.parametrize("backend_name", available_backends())
@pytest.mark.parametrize(("dim", "groups"), [(2, 1), (2, 8), (1, 1)])
def test_conv_to_float_is_the_hand_computed_accumulator(backend_name: str, dim: int, groups: int) -> None:
    kernel = (3,) * dim
    backend = get_backend(backend_name)
    qmax = backend.activation_qrange(feeds_grouped_conv=groups > 1)[1]
    weight, w_qp, in_qp, bias = _layer(16, (8 // groups, *kernel), 0.02, qmax)
    zero_point = int(in_qp.zero_point)
    q_x = _integers((2, 8, *(7,) * dim), 0, qmax)
    spec = ConvSpec(dim, (1,) * dim, (1,) * dim, (1,) * dim, groups)
    conv = F.conv2d if dim == 2 else F.conv1d  # float64 sums of integer products below 2**53: exact
    acc = conv(q_x.double() - zero_point, weight.double(), None, 1, 1, 1, groups)
    per_channel = (0.02 * w_qp.scale.double()).reshape(-1, *(1,) * dim)
    expected = acc * per_channel + bias.double().reshape(-1, *(1,) * dim)
    out_qp = QParams(torch.tensor(float(expected.abs().max()) / 127), torch.tensor(128), 0, 255)
    a = backend.quantize((q_x.float() - zero_point) * 0.02, in_qp)
    packed = backend.prepack_conv(weight, w_qp, bias, spec, in_qp=in_qp)
    got = backend.conv_to_float(a, packed, in_qp, out_qp, relu=False)
    _check(backend_name, got.contiguous(), expected, out_qp, exact=backend.fuses_float_conv_output)


class _Block(nn.Module):
    """``LayerNorm(fc2(gelu(fc1(x))) + x)``: a transformer FFN with its residual add read by a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(F.gelu(self.fc1(x))) + x)


def _count(gm: torch.fx.GraphModule, *types: type) -> int:
    modules = dict(gm.named_modules())
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[str(n.target)], types))


@pytest.mark.parametrize("backend_name", available_backends())
def test_residual_add_read_by_layernorm_stays_float(backend_name: str) -> None:
    prepared = calibrated(_Block().eval(), (4, 8, 16))
    observers = [m for m in prepared.modules() if isinstance(m, Observer) and m.kind == "activation"]
    assert len(observers) == 4  # x, fc1's output, gelu's output, fc2's output: none after the add
    qmodel = fxquant.convert(prepared, backend=backend_name)
    gelu_fused = "gelu" in get_backend(backend_name).fused_linear_unary  # fc1 then quantizes gelu's output itself
    fuses = get_backend(backend_name).fuses_float_output  # else fc1's int8 output goes through a GELU table
    assert _count(qmodel, QuantizedAdd) == 0 and _count(qmodel, Quantize) == (1 if gelu_fused or not fuses else 2)
    assert qmodel.get_submodule("fc1").unary == ("gelu" if gelu_fused else None)
    assert _count(qmodel, DeQuantize) == (0 if fuses else 1)  # fc2's output, into the add
    assert qmodel.get_submodule("fc2").float_output is fuses
    rows = {row.path: row for row in fxquant.coverage(qmodel).layers}
    assert rows["fc2"].quantized and ("float output" in rows["fc2"].reason) is fuses
    x = torch.randn(4, 8, 16)
    with torch.inference_mode():
        assert_sqnr(simulate(prepared, backend_name)(x), qmodel(x), 35.0, f"{backend_name} INT8 vs fake-quant")


class _PreLN(nn.Module):
    """Two pre-LN residual blocks: each add feeds the next block's LayerNorm and the next add."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.LayerNorm(16), nn.LayerNorm(16)])
        self.fcs = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, fc in zip(self.norms, self.fcs, strict=True):
            x = x + fc(norm(x))
        return x


def test_pre_ln_residual_stream_stays_float() -> None:
    qmodel = fxquant.convert(calibrated(_PreLN().eval(), (4, 8, 16)), backend="reference")
    assert _count(qmodel, QuantizedAdd) == 0 and _count(qmodel, DeQuantize) == 0
    assert all(qmodel.get_submodule(f"fcs.{i}").float_output for i in range(2))


def test_adds_with_int8_readers_or_only_int8_inputs_stay_int8() -> None:
    class Residuals(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            int8_reader = self.b(torch.relu(self.a(x) + x))  # read by an int8 Linear (through a ReLU)
            return torch.layer_norm(self.c(int8_reader) + int8_reader, (8,))  # both inputs int8

    qmodel = fxquant.convert(calibrated(Residuals().eval(), (4, 8)), backend="reference")
    assert _count(qmodel, QuantizedAdd) == 2


def _bert_style_sqnr(backend_name: str, rule: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[float, float]:
    model = create_model("bert_style", hidden=64, layers=2, heads=4, intermediate=128, seq_len=32).eval()
    data = [tuple(t[:, :32] for t in example_inputs("bert_style", 4, seed=i)) for i in range(6)]
    with monkeypatch.context() as patch:
        if not rule:
            patch.setattr(_insert_observers, "float_residual_add", lambda *_: False)
        prepared = fxquant.prepare(model, data[0])
    fxquant.calibrate(prepared, data[1:5], progress=False)
    qmodel = fxquant.convert(prepared, backend=backend_name)
    with torch.inference_mode():
        out = qmodel(*data[5])
        return sqnr_db(model(*data[5]), out), sqnr_db(simulate(prepared, backend_name)(*data[5]), out)


@pytest.mark.parametrize("backend_name", ["reference", "fbgemm"])
def test_bert_style_sqnr_improves_with_float_residual_adds(backend_name: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if backend_name not in available_backends():
        pytest.skip(f"{backend_name} is not available")
    before, _ = _bert_style_sqnr(backend_name, False, monkeypatch)
    after, vs_simulation = _bert_style_sqnr(backend_name, True, monkeypatch)
    print(f"bert_style on {backend_name}: INT8 vs FP32 {before:.1f} dB -> {after:.1f} dB; "
          f"vs its fake-quant model {vs_simulation:.1f} dB")
    assert after >= before + 10.0, f"{backend_name}: {before:.1f} dB -> {after:.1f} dB"
    assert vs_simulation >= 40.0, f"{backend_name}: INT8 vs fake-quant {vs_simulation:.1f} dB"


class _Diamonds(nn.Module):
    """A float value through 16 levels of ``relu(x) + relu(x)`` (two readers joining again) into a LayerNorm:
    every add mixes in a float value and only float code reads the end, so all of them stay float."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sigmoid(self.fc(x)) * 2.0
        for _ in range(16):
            x = torch.relu(x) + torch.relu(x)
        return self.norm(x)


def test_reader_queries_walk_a_fanned_out_graph_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without memoisation each add's query walks every path to the output: 2^16 per add here."""
    float_outputs = importlib.import_module("fxquant.passes.float_outputs")
    calls = 0
    classify = float_outputs.classify

    def counting(node: torch.fx.Node, modules: object) -> object:
        nonlocal calls
        calls += 1
        return classify(node, modules)

    monkeypatch.setattr(float_outputs, "classify", counting)
    prepared = fxquant.prepare(_Diamonds().eval(), (torch.randn(2, 8),))
    graph_nodes = len(prepared.graph.nodes)
    assert calls < 20 * graph_nodes * graph_nodes, f"{calls} classify calls for {graph_nodes} nodes"
    assert not any(isinstance(m, Observer) and "add" in path for path, m in prepared.named_modules())

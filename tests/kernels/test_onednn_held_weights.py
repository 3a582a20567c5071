"""A Linear on fxquant's oneDNN primitives keeps one int8 copy of its weight, the one reordered into oneDNN's layout
(``fxquant.kernels.onednn.weights.pack_linear``), or on CPUs without VNNI the AVX2 row loop's
(``fxquant.kernels.onednn.rows``, tests/kernels/test_onednn_rows.py): the plain weight is read back from it wherever
it is needed, byte for byte. Each test checks against a layer that keeps the plain weight (the reference backend's,
or the torch ops' path with fxquant's primitives hidden)."""

from __future__ import annotations

import copy
import platform
import sys
from pathlib import Path

import pytest
import torch
from kernel_contract_cases import make_layer
from torch import nn

import fxquant
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.onednn.weights import OnednnWeight
from fxquant.kernels.registry import get_backend
from fxquant.nn.quantized import QuantizedConvNd, QuantizedLinear
from fxquant.qparams import QParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _bench_llm_weights import weight_bytes  # scripts/ is not a package

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or not onednn_direct.available(),
                                reason=f"fxquant's oneDNN primitives do not run here: {onednn_direct.status()}")

OUT_QP = QParams(torch.tensor(0.37), torch.tensor(11), 0, 255)
FLOAT = (1.0, 0, torch.float32)


def _converted(backend: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 70), nn.ReLU(), nn.Linear(70, 17)).eval()
    x = torch.randn(16, 33)
    prepared = fxquant.prepare(model, (x,), fxquant.QuantConfig(backend=backend))
    prepared(x)
    return fxquant.convert(prepared), x


def _linears(model: nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def _held_copies(w: OnednnWeight) -> int:
    """The int8 copies a Linear's weight holds: a primitive's reordered one each, and the AVX2 row loop's layout,
    which holds it instead on CPUs without VNNI (``fxquant.kernels.onednn.rows``)."""
    return sum(p.weights_bytes > 0 for p in w.shared) + (w.row_layout is not None)


def _held_bytes(w: OnednnWeight) -> int:
    return sum(p.weights_bytes for p in w.shared) + (0 if w.row_layout is None else w.row_layout.numel())


def test_a_layer_keeps_one_copy_and_reads_the_plain_weight_back_exactly() -> None:
    held, x = _converted("onednn")
    plain, _ = _converted("reference")
    for layer, reference in zip(_linears(held), _linears(plain), strict=True):
        assert "weight" not in layer._buffers and "weight" in reference._buffers
        assert torch.equal(layer.weight, reference.weight)
        w = layer._packed.payload
        assert w.holds_weight() and w.plain is None
        assert _held_copies(w) == 1  # one reordered copy, nothing else
    assert list(held.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        if key.endswith("weight"):
            assert torch.equal(held.state_dict()[key], value), key
    twin = copy.deepcopy(held)
    assert torch.equal(twin(x), held(x))
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(_linears(twin), _linears(plain), strict=True))


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 7)])
def test_calls_on_the_held_weight_give_the_torch_ops_integers(monkeypatch: pytest.MonkeyPatch,
                                                              lead: tuple[int, ...]) -> None:
    """Every input shape gives the integers of the op on the plain weight (a call past the cache of bound calls:
    tests/kernels/test_onednn_backend.py)."""
    onednn = get_backend("onednn")
    layer = make_layer((*lead, 40), (24, 40), qrange=(0, 255), per_channel=True, bias=True, seed=3)
    held = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias, in_qp=layer.in_qp)
    with monkeypatch.context() as patch:
        patch.setattr(onednn_direct, "available", lambda: False)
        ops = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias, in_qp=layer.in_qp)
    assert onednn.holds_weight(held) and not onednn.holds_weight(ops)
    expected = onednn.linear(layer.q_x, ops, layer.in_qp, OUT_QP, relu=False)
    assert torch.equal(onednn.linear(layer.q_x, held, layer.in_qp, OUT_QP, relu=False), expected)
    assert held.payload.packed is None  # no op's copy beside the primitives'


def test_a_layout_no_primitive_holds_is_reordered_from_a_plain_copy_made_for_it() -> None:
    """Given a function for the weight, a primitive takes the reordered weights of one in ``shared`` where the
    layout matches (the function is not called), and otherwise makes the plain weight once for its reorder."""
    layer = make_layer((3, 40), (24, 40), qrange=(0, 255), per_channel=False, bias=False, seed=4)
    calls: list[int] = []

    def plain() -> torch.Tensor:
        calls.append(1)
        return layer.q_w.clone()

    scale = layer.w_qp.scale.reshape(1)
    x_qp = layer.in_qp.scalar()
    from_plain = onednn_direct.linear(layer.q_w, 24, scale, None, (3, 40), x_qp, FLOAT, "none", [])
    shared: list[object] = []
    made = onednn_direct.linear(plain, 24, scale, None, (3, 40), x_qp, FLOAT, "none", shared)
    assert from_plain is not None and made is not None and calls == [1] and len(shared) == 1
    again = onednn_direct.linear(plain, 24, scale, None, (3, 40), x_qp, FLOAT, "none", shared)
    assert again is not None and calls == [1] and again.primitive.weights_address == shared[0].weights_address
    for call in (made, again):
        assert torch.equal(call(layer.q_x), from_plain(layer.q_x))
    assert onednn_direct._dnnl is not None
    with pytest.raises(LookupError, match="no primitive in share"):
        onednn_direct._dnnl.Primitive(None, [24, 40], [3, 40], [40, 1], [3, 24], [24, 1], "f32",
                                      scale.numpy().tobytes(), None, 0.1, 0, 1.0, 0, None, (), None, [])


def test_loading_a_state_dict_repacks_the_held_weight() -> None:
    """The loaded weight is what the primitives compute with (not the copy they held before)."""
    held, x = _converted("onednn")
    layer = _linears(held)[0]
    before = layer.weight
    state = held.state_dict()
    state["0.weight"] = -before
    held.load_state_dict(state)
    assert "weight" not in layer._buffers and torch.equal(layer.weight, -before)
    onednn = get_backend("onednn")
    fresh = onednn.prepack_linear(-before, layer.w_qp, layer.bias, in_qp=layer.in_qp)
    a = onednn.quantize(x, layer.in_qp)
    assert torch.equal(layer(a), onednn.linear(a, fresh, layer.in_qp, layer.out_qp, relu=layer.relu))


def test_relowering_away_and_back_keeps_the_weight() -> None:
    held, x = _converted("onednn")
    expected = held(x)
    weights = [layer.weight for layer in _linears(held)]
    for layer in _linears(held):
        layer.relower(get_backend("reference"))
    assert all("weight" in layer._buffers for layer in _linears(held))
    assert all(torch.equal(layer.weight, w) for layer, w in zip(_linears(held), weights, strict=True))
    for layer in _linears(held):
        layer.relower(get_backend("onednn"))
    assert all("weight" not in layer._buffers for layer in _linears(held))
    assert torch.equal(held(x), expected)


@pytest.mark.parametrize("block", [64, 48])  # 48: not oneDNN's blocks of outputs here, so the whole weight is read
def test_rows_are_read_back_by_blocks_of_outputs(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """What a tied embedding reads from a held head: any rows, repeated, in the last partial block, or out of
    range (IndexError, as ``nn.Embedding``)."""
    monkeypatch.setattr("fxquant.kernels.onednn.weights.ROW_BLOCK", block)
    layer = make_layer((1, 33), (70, 33), qrange=(0, 255), per_channel=True, bias=False, seed=6)
    held = get_backend("onednn").prepack_linear(layer.q_w, layer.w_qp, None, in_qp=layer.in_qp).payload
    assert held.holds_weight()
    outputs = torch.tensor([69, 0, 64, 64, 5, 47, 48])
    assert torch.equal(held.rows(outputs), layer.q_w.index_select(0, outputs))
    assert held.rows(outputs[:0]).shape == (0, 33)
    for wrong in (70, -1):
        with pytest.raises(IndexError):
            held.rows(torch.tensor([3, wrong]))


def test_the_benchmarks_weight_count_sees_one_copy() -> None:
    """``bench_llm.py``'s weights column counts the primitives' reordered copies, and not the plain weight that
    ``state_dict()`` reads back on each call (it is not resident)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).eval()
    x = torch.randn(8, 256)
    prepared = fxquant.prepare(model, (x,), fxquant.QuantConfig(backend="onednn"))
    prepared(x)
    held = fxquant.convert(prepared)
    reordered = sum(_held_bytes(layer._packed.payload) for layer in _linears(held))
    int8 = sum(layer.weight.numel() for layer in _linears(held))
    assert reordered >= int8
    # beside the reordered copy: scales, biases, qparams, calibration statistics; a plain copy would add ``int8``
    assert reordered <= weight_bytes(held) < reordered + int8


def test_loading_a_state_dict_repacks_a_conv_too() -> None:
    """A conv keeps its plain weight, but its primitives and the op's packing hold copies of it: loaded weights
    reach them as well."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval()
    x = torch.randn(2, 3, 10, 10)
    prepared = fxquant.prepare(model, (x,), fxquant.QuantConfig(backend="onednn"))
    prepared(x)
    converted = fxquant.convert(prepared)
    conv = next(m for m in converted.modules() if isinstance(m, QuantizedConvNd))
    onednn = get_backend("onednn")
    a = onednn.quantize(x, conv.in_qp)
    before = conv(a)
    state = converted.state_dict()
    key = next(k for k in state if k.endswith("weight") and state[k].dtype == torch.int8)
    state[key] = -state[key]
    converted.load_state_dict(state)
    assert torch.equal(conv.weight, state[key])
    fresh = onednn.prepack_conv(conv.weight.clone(), conv.w_qp, conv.bias, conv.spec, in_qp=conv.in_qp)
    after = conv(a)
    run = onednn.conv_to_float if conv.float_output else onednn.conv  # (float: the model's output)
    assert torch.equal(after, run(a, fresh, conv.in_qp, conv.out_qp, relu=conv.relu))
    assert not torch.equal(after, before)

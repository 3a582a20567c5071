"""The onednn backend's few-row Linears on the AVX2 row loop (``fxquant.kernels.onednn.rows``) against oneDNN's own
matmul primitive, built by fxquant for the same layer: the same bytes (uint8, with and without ReLU, on 7-bit outputs)
and float32 values, with the loop seen to run; the calls it leaves to the primitive; the weight it holds.

The loop runs where AVX2 is the highest instruction set fxquant may use: CPUs with AVX2 alone, or ``FXQUANT_ISA=avx2``
on any x86-64 CPU (``.ci/run`` runs this file so); elsewhere these tests skip and say why.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_contract_cases import (
    ONEDNN_PRIMITIVES,
    Layer,
    activation_range,
    count_calls,
    loop_threads,
    make_layer,
    require_avx2_alone,
)

from fxquant import native
from fxquant.kernels.base import PackedWeight
from fxquant.kernels.onednn import rows as onednn_rows
from fxquant.kernels.registry import get_backend
from fxquant.qparams import QParams

pytestmark = ONEDNN_PRIMITIVES

OUT_QP = QParams(torch.tensor(0.37), torch.tensor(11), 0, 127)  # a 7-bit output, as convert gives without VNNI
SHAPES = [(33, 17), (1000, 130), (64, 64), (7, 200)]  # (in, out): inputs not a multiple of 4, outputs of 8 or 64


def _run(packed: PackedWeight, x: torch.Tensor, in_qp: QParams, output: str) -> torch.Tensor:
    onednn = get_backend("onednn")
    if output == "float":
        return onednn.linear_to_float(x, packed, in_qp, OUT_QP, relu=False)
    return onednn.linear(x, packed, in_qp, OUT_QP, relu=output == "uint8+relu")


def _on_the_primitive(monkeypatch: pytest.MonkeyPatch, layer: Layer, folded: bool, output: str) -> torch.Tensor:
    """The same call with the loop declined: fxquant's oneDNN matmul primitive computes it, on the weight packed as
    without the loop (held by the pack-time primitive, not read back from the loop's layout)."""
    with monkeypatch.context() as patch:
        patch.setattr(onednn_rows, "row_call", lambda *args: None)
        patch.setattr(onednn_rows, "takes_one_row", lambda in_qp: False)
        packed = get_backend("onednn").prepack_linear(layer.q_w, layer.w_qp, layer.bias,
                                                      in_qp=layer.in_qp if folded else None)
        out = _run(packed, layer.q_x, layer.in_qp, output)
    assert packed.payload.row_layout is None and packed.payload.shared
    assert not any(hasattr(call, "loop") for call in packed.payload.calls.values())
    return out


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize(("output", "per_channel", "folded"), [("uint8", True, True), ("uint8+relu", False, False),
                                                                ("float", True, False), ("uint8+relu", True, True)])
def test_the_loop_gives_the_primitives_bytes(monkeypatch: pytest.MonkeyPatch, k: int, n: int, rows: int,
                                             output: str, per_channel: bool, folded: bool) -> None:
    """uint8 results bit for bit, float32 results exactly (oneDNN multiplies the sum by s_x * s_w, then adds the
    bias: not fused); the input zero point folded into the bias (the weight held in the loop's layout) and not
    (the loop subtracts it from the sums, the weight held by the pack-time primitive)."""
    require_avx2_alone("row loop")
    layer = make_layer((rows, k), (n, k), qrange=activation_range("onednn"), per_channel=per_channel, bias=True,
                       seed=rows * 100 + k)
    assert layer.in_qp.qmax == 127
    calls = count_calls(monkeypatch, "linear_rows_onednn")
    with loop_threads(onednn_rows.FAMILY):  # (packing too: it holds the weight in the loop's layout where it runs)
        packed = get_backend("onednn").prepack_linear(layer.q_w, layer.w_qp, layer.bias,
                                                      in_qp=layer.in_qp if folded else None)
        assert (packed.payload.row_layout is not None) == folded  # packed for 7-bit inputs: in the loop's layout
        mine = _run(packed, layer.q_x, layer.in_qp, output)
        theirs = _on_the_primitive(monkeypatch, layer, folded, output)
    assert calls == [1], "the row loop did not run: the test would compare the primitive with itself"
    assert mine.shape == theirs.shape == (rows, n) and mine.dtype == theirs.dtype
    assert torch.equal(mine, theirs), f"max |diff| {float((mine.float() - theirs.float()).abs().max())}"


def test_saturated_sums_stay_at_the_top_of_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sums far past the output range (every input and weight at its largest) give 127, and far below it 0, as
    the primitive's clip does: the loop saturates in float before rounding."""
    require_avx2_alone("row loop")
    layer = make_layer((2, 1000), (64, 1000), qrange=(0, 127), per_channel=False, bias=False, seed=1)
    weight = torch.cat([torch.full((32, 1000), 127), torch.full((32, 1000), -128)]).to(torch.int8)
    layer = dataclasses.replace(layer, q_x=torch.full((2, 1000), 127, dtype=torch.uint8), q_w=weight,
                                in_qp=QParams(torch.tensor(0.05), torch.tensor(0), 0, 127))
    calls = count_calls(monkeypatch, "linear_rows_onednn")
    with loop_threads(onednn_rows.FAMILY):
        packed = get_backend("onednn").prepack_linear(layer.q_w, layer.w_qp, None, in_qp=layer.in_qp)
        mine = _run(packed, layer.q_x, layer.in_qp, "uint8")
        theirs = _on_the_primitive(monkeypatch, layer, True, "uint8")
    assert calls == [1]
    assert torch.equal(mine, theirs)
    assert mine[:, :32].eq(127).all() and mine[:, 32:].eq(0).all()


@pytest.mark.parametrize("case", ["33 rows", "8-bit inputs", "fused SiLU", "above the thread limit"])
def test_the_primitive_keeps_what_the_loop_does_not_take(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Above :data:`MAX_ROWS` rows oneDNN's GEMM keeps the call (the loop's gain falls under 5% there); 8-bit inputs
    would saturate the loop's 16-bit pair sums; a unary post-op other than ReLU is oneDNN's to compute; above the
    family's thread limit (not measured there) the primitive splits the layer over torch's threads. Each runs the
    primitive, with the same result as with the loop declined."""
    require_avx2_alone("row loop")
    rows = onednn_rows.MAX_ROWS + 1 if case == "33 rows" else 2
    qrange = (0, 255) if case == "8-bit inputs" else (0, 127)
    layer = make_layer((rows, 40), (24, 40), qrange=qrange, per_channel=True, bias=True, seed=2)
    onednn = get_backend("onednn")
    calls = count_calls(monkeypatch, "linear_rows_onednn")
    threads = native.THREAD_LIMITS[onednn_rows.FAMILY] + 1 if case == "above the thread limit" else 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias, in_qp=layer.in_qp)
        if case == "fused SiLU":
            out = onednn.linear_unary(layer.q_x, packed, layer.in_qp, OUT_QP, "silu", OUT_QP)
        else:
            out = _run(packed, layer.q_x, layer.in_qp, "uint8")
    finally:
        torch.set_num_threads(previous)
    assert calls == []
    assert out.shape == (rows, 24)
    if case != "fused SiLU":
        assert torch.equal(out, _on_the_primitive(monkeypatch, layer, True, "uint8"))


def test_a_weight_held_in_the_loops_layout_reads_back_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain weight, any rows of it (a tied embedding's lookup), and a many-row call (a primitive built from
    the weight read back) are what a layer keeping the plain weight gives."""
    require_avx2_alone("row loop")
    layer = make_layer((40, 33), (70, 33), qrange=(0, 127), per_channel=True, bias=True, seed=6)
    with loop_threads(onednn_rows.FAMILY):
        held = get_backend("onednn").prepack_linear(layer.q_w, layer.w_qp, layer.bias, in_qp=layer.in_qp)
    w = held.payload
    assert w.holds_weight() and w.plain is None and w.row_layout is not None and w.shared == []
    assert w.row_layout.numel() == 2 * 64 * 36  # two blocks of 64 outputs x 33 inputs padded to 36: one copy
    assert torch.equal(w.unpacked(), layer.q_w)
    outputs = torch.tensor([69, 0, 64, 64, 5, 47, 48])
    assert torch.equal(w.rows(outputs), layer.q_w.index_select(0, outputs))
    assert w.rows(outputs[:0]).shape == (0, 33)
    with pytest.raises(IndexError):
        w.rows(torch.tensor([3, 70]))
    many = _run(held, layer.q_x, layer.in_qp, "uint8")  # 40 rows: oneDNN's primitive, from the weight read back
    assert torch.equal(many, _on_the_primitive(monkeypatch, layer, True, "uint8"))


def test_the_loops_calls_on_one_weight_share_one_copy_of_its_layout() -> None:
    """Packed without the input's qparams, the pack-time primitive holds the weight; the loop's calls on several row
    counts make the loop's layout once, on the weight, and all read that copy."""
    require_avx2_alone("row loop")
    layer = make_layer((3, 40), (24, 40), qrange=(0, 127), per_channel=True, bias=True, seed=7)
    with loop_threads(onednn_rows.FAMILY):
        packed = get_backend("onednn").prepack_linear(layer.q_w, layer.w_qp, layer.bias, in_qp=None)
        assert packed.payload.row_layout is None and packed.payload.shared
        for rows in (1, 3):
            _run(packed, layer.q_x[:rows], layer.in_qp, "uint8")
    loops = [call.loop for call in packed.payload.calls.values()]
    assert len(loops) == 2 and all(loop.tensors[0] is packed.payload.row_layout for loop in loops)

"""The onednn backend's 3x3 convs as Winograd F(2x2, 3x3) (``fxquant.kernels.onednn.winograd``) against oneDNN's own
conv primitive, built by fxquant for the same layer: the same bytes, with and without ReLU, with the sum post-op
(conv + add), across geometries, thread counts and the input zero point folded or not, with the kernel seen to run;
the calls it leaves to the primitive; the one transformed weight it keeps; a replay of its recorded call. The
transform itself is checked against the direct sum in integers, with no oneDNN involved.

The kernel runs where AVX2 is the highest instruction set fxquant may use: CPUs with AVX2 alone, or
``FXQUANT_ISA=avx2`` on any x86-64 CPU (``.ci/run`` runs this file so); elsewhere these tests skip and say why.
"""

from __future__ import annotations

import pytest
import torch
from kernel_contract_cases import (
    ONEDNN_PRIMITIVES,
    Layer,
    at_thread_counts,
    count_calls,
    declined,
    loop_threads,
    make_layer,
    require_avx2_alone,
)

from fxquant import native
from fxquant.kernels import recording
from fxquant.kernels.base import ConvAddQParams, ConvSpec, PackedWeight
from fxquant.kernels.onednn import winograd as onednn_winograd
from fxquant.kernels.onednn.weights import operands
from fxquant.kernels.registry import get_backend
from fxquant.native.winograd import transformed_weight
from fxquant.qparams import QParams

pytestmark = ONEDNN_PRIMITIVES

OUT_QP = QParams(torch.tensor(0.37), torch.tensor(11), 0, 127)  # a 7-bit output, as convert gives without VNNI
ACCUM_QP = QParams(torch.tensor(0.21), torch.tensor(5), 0, 127)
# (batch, in channels, out channels, height, width, padding): channels not a multiple of 16, odd sizes (a tile
# half outside the output), a row of one, the largest padding, ResNet's deepest layer
GEOMETRIES = [(1, 64, 64, 14, 14, 1), (2, 40, 24, 9, 7, 1), (1, 32, 5, 5, 6, 0), (1, 33, 33, 8, 8, 2),
              (3, 48, 16, 1, 3, 1), (1, 512, 512, 7, 7, 1)]


def _layer(geometry: tuple[int, ...], per_channel: bool, bias: bool, seed: int) -> tuple[Layer, ConvSpec]:
    n, c, k, h, w, pad = geometry
    layer = make_layer((n, c, h, w), (k, c, 3, 3), qrange=(0, 127), per_channel=per_channel, bias=bias, seed=seed)
    return layer, ConvSpec(2, (1, 1), (pad, pad), (1, 1), 1)


def _accum(layer: Layer, spec: ConvSpec) -> torch.Tensor:
    n, _, h, w = layer.q_x.shape
    shape = (n, layer.q_w.shape[0], h + 2 * spec.padding[0] - 2, w + 2 * spec.padding[1] - 2)
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 128, shape, generator=gen, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)


def _conv(layer: Layer, spec: ConvSpec, *, relu: bool, add: bool,
          folded: bool = True) -> tuple[torch.Tensor, PackedWeight]:
    """The layer's conv (conv + add with ``add``) on the onednn backend, and its packed weight. ``folded``: packed
    with the input's qparams (an unpadded conv then folds the input zero point into its bias)."""
    onednn = get_backend("onednn")
    packed: PackedWeight = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec,
                                               in_qp=layer.in_qp if folded else _other_qparams(layer.in_qp))
    a = layer.q_x.contiguous(memory_format=torch.channels_last)
    if add:
        qps = ConvAddQParams(layer.in_qp, OUT_QP, ACCUM_QP, OUT_QP)
        return onednn.conv_add(a, packed, _accum(layer, spec), qps, relu=relu), packed
    return onednn.conv(a, packed, layer.in_qp, OUT_QP, relu=relu), packed


def _other_qparams(qp: QParams) -> QParams:
    """Other input qparams than ``qp``: packed for them, a call on ``qp`` keeps its zero point (nothing folded)."""
    return QParams(qp.scale * 2, qp.zero_point, qp.qmin, qp.qmax)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize(("per_channel", "bias", "relu", "add"),
                         [(True, True, True, False), (False, False, False, False), (True, True, True, True),
                          (False, True, False, True)])
def test_the_kernel_gives_the_primitives_bytes(monkeypatch: pytest.MonkeyPatch, geometry: tuple[int, ...],
                                               per_channel: bool, bias: bool, relu: bool, add: bool) -> None:
    """uint8 results bit for bit against oneDNN's conv primitive on the same layer: the integer sums are oneDNN's and
    so is the requantization (the sum post-op reads the accumulator the call overwrites)."""
    require_avx2_alone("Winograd convs")
    layer, spec = _layer(geometry, per_channel, bias, seed=sum(geometry))
    calls = count_calls(monkeypatch, "conv3x3_onednn")
    with loop_threads(onednn_winograd.FAMILY):
        mine, packed = _conv(layer, spec, relu=relu, add=add)
        with declined(monkeypatch, onednn_winograd, "winograd_call"):
            theirs, primitive = _conv(layer, spec, relu=relu, add=add)
    assert calls == [1], "the Winograd kernel did not run: the test would compare the primitive with itself"
    assert any(hasattr(call, "loop") for call in packed.payload.calls.values())
    assert not any(hasattr(call, "loop") for call in primitive.payload.calls.values())
    assert mine.shape == theirs.shape and mine.is_contiguous(memory_format=torch.channels_last)
    assert int(mine.max()) > 0 and int(mine.min()) < 127, "a saturated output would hide the sums"
    assert torch.equal(mine, theirs), f"{int((mine.int() - theirs.int()).abs().max())} steps apart"


@pytest.mark.parametrize("folded", [True, False])
def test_the_input_zero_point_folded_or_not(monkeypatch: pytest.MonkeyPatch, folded: bool) -> None:
    """An unpadded conv packed for its input's qparams folds the zero point into the bias (the kernel sums the
    uncentered inputs); packed for others, the kernel centers the inputs itself: the primitive's bytes both ways."""
    require_avx2_alone("Winograd convs")
    layer, spec = _layer((2, 40, 24, 10, 11, 0), per_channel=True, bias=True, seed=5)
    assert int(layer.in_qp.zero_point) != 0
    calls = count_calls(monkeypatch, "conv3x3_onednn")
    with loop_threads(onednn_winograd.FAMILY):
        mine, packed = _conv(layer, spec, relu=True, add=False, folded=folded)
        with declined(monkeypatch, onednn_winograd, "winograd_call"):
            theirs, _ = _conv(layer, spec, relu=True, add=False, folded=folded)
    assert (operands(packed.payload, layer.in_qp)[1] == 0) == folded  # the zero point the call passes
    assert calls == [1]
    assert torch.equal(mine, theirs)


def test_the_widest_layer_sums_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """:data:`MAX_CHANNELS` input channels, every input at 0 or 127 and every weight at -128 or 127: sums of tens of
    millions (up to 9 * 1024 * 127 * 128), read at an output scale that spreads them over the range, are the
    primitive's."""
    require_avx2_alone("Winograd convs")
    c = onednn_winograd.MAX_CHANNELS
    layer, spec = _layer((1, c, 16, 4, 5, 1), per_channel=False, bias=False, seed=8)
    gen = torch.Generator().manual_seed(9)
    q_x = torch.randint(0, 2, layer.q_x.shape, generator=gen).mul(127).to(torch.uint8)
    q_w = torch.where(torch.rand(layer.q_w.shape, generator=gen) < 0.7, 127, -128).to(torch.int8)
    layer = Layer(q_x, QParams(torch.tensor(1.0), torch.tensor(0), 0, 127), q_w,
                  QParams(torch.tensor(1.0), torch.tensor(0), -128, 127), None)
    largest = float(torch.nn.functional.conv2d(q_x.double(), q_w.double(), padding=1).max())
    assert largest > 2**24, "sums this large are not exact in float32: the kernel must keep them in int32"
    wide = QParams(torch.tensor(largest / 120), torch.tensor(0), 0, 127)
    calls = count_calls(monkeypatch, "conv3x3_onednn")
    with loop_threads(onednn_winograd.FAMILY):
        onednn = get_backend("onednn")
        a = q_x.contiguous(memory_format=torch.channels_last)
        mine = onednn.conv(a, onednn.prepack_conv(q_w, layer.w_qp, None, spec, in_qp=layer.in_qp), layer.in_qp,
                           wide, relu=False)
        with declined(monkeypatch, onednn_winograd, "winograd_call"):
            theirs = onednn.conv(a, onednn.prepack_conv(q_w, layer.w_qp, None, spec, in_qp=layer.in_qp), layer.in_qp,
                                 wide, relu=False)
    assert calls == [1]
    assert int(mine.max()) >= 119 and len(mine.unique()) > 20, "the sums should spread over the output's range"
    assert torch.equal(mine, theirs)


def test_the_bytes_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread and two (its limit) give the same bytes: each output is one thread's, summed in one order."""
    require_avx2_alone("Winograd convs")
    layer, spec = _layer((1, 256, 256, 14, 14, 1), per_channel=True, bias=True, seed=10)
    calls = count_calls(monkeypatch, "conv3x3_onednn")
    outs = at_thread_counts(onednn_winograd.FAMILY, lambda: _conv(layer, spec, relu=True, add=True)[0])
    assert len(calls) == 2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("case", ["stride 2", "dilation 2", "two groups", "5x5", "8-bit inputs", "float output",
                                  "fused hardswish", "too few channels", "too many channels", "above the thread limit"])
def test_the_primitive_keeps_what_the_kernel_does_not_take(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Geometries Winograd F(2x2, 3x3) does not compute, 8-bit inputs (oneDNN's pair sums saturate on them, the
    kernel's would not: not the primitive's bytes), outputs other than uint8 with a ReLU, fewer input channels than
    it is measured faster on, more than the sums are bounded for, and thread counts it was not measured at go to
    oneDNN's primitive."""
    require_avx2_alone("Winograd convs")
    c = {"too few channels": onednn_winograd.MIN_CHANNELS - 8,
         "too many channels": onednn_winograd.MAX_CHANNELS + 8}.get(case, onednn_winograd.MIN_CHANNELS)
    kernel, groups = (5 if case == "5x5" else 3), (2 if case == "two groups" else 1)
    spec = ConvSpec(2, (2, 2) if case == "stride 2" else (1, 1), (1, 1), (2, 2) if case == "dilation 2" else (1, 1),
                    groups)
    layer = make_layer((1, c, 9, 9), (8, c // groups, kernel, kernel), qrange=(0, 255) if case == "8-bit inputs"
                       else (0, 127), per_channel=True, bias=True, seed=11)
    onednn = get_backend("onednn")
    calls = count_calls(monkeypatch, "conv3x3_onednn")
    previous = torch.get_num_threads()
    torch.set_num_threads(native.THREAD_LIMITS[onednn_winograd.FAMILY] + 1 if case == "above the thread limit" else 1)
    try:
        packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
        a = layer.q_x.contiguous(memory_format=torch.channels_last)
        if case == "float output":
            out = onednn.conv_to_float(a, packed, layer.in_qp, OUT_QP, relu=True)
        elif case == "fused hardswish":
            out = onednn.conv_unary(a, packed, layer.in_qp, OUT_QP, "hardswish", OUT_QP)
        else:
            out = onednn.conv(a, packed, layer.in_qp, OUT_QP, relu=True)
    finally:
        torch.set_num_threads(previous)
    assert calls == []
    assert packed.payload.winograd is None
    assert out.shape[:2] == (1, 8)


def test_calls_on_one_weight_share_its_transformed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two input shapes bind two calls; the weight is transformed once, on the weight, and both read that copy."""
    require_avx2_alone("Winograd convs")
    layer, spec = _layer((2, 32, 24, 8, 8, 1), per_channel=True, bias=True, seed=12)
    onednn = get_backend("onednn")
    with loop_threads(onednn_winograd.FAMILY):
        packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
        for batch in (1, 2):
            a = layer.q_x[:batch].contiguous(memory_format=torch.channels_last)
            onednn.conv(a, packed, layer.in_qp, OUT_QP, relu=True)
    loops = [call.loop for call in packed.payload.calls.values()]
    assert len(loops) == 2 and all(loop.tensors[0] is packed.payload.winograd for loop in loops)


def test_a_recorded_call_replays_on_its_addresses() -> None:
    """A call logs one :data:`~fxquant.kernels.recording.AddressCall` (a replayed run holds the layer); repeating it
    on the same input into another buffer writes the same bytes."""
    require_avx2_alone("Winograd convs")
    layer, spec = _layer((1, 32, 32, 12, 12, 1), per_channel=True, bias=True, seed=13)
    onednn = get_backend("onednn")
    with loop_threads(onednn_winograd.FAMILY):
        packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
        a = layer.q_x.contiguous(memory_format=torch.channels_last)
        with recording.recording() as log:
            out = onednn.conv(a, packed, layer.in_qp, OUT_QP, relu=True)
        assert len(log) == 1 and log[0] is not None
        run, src, dst, tensor = log[0]
        assert src == a.data_ptr() and dst == out.data_ptr() and tensor is out
        again = torch.zeros_like(out)
        run(src, again.data_ptr())
    assert torch.equal(again, out)


def test_the_transform_gives_four_times_the_direct_sums() -> None:
    """The algorithm itself, in int64 with no oneDNN: for a 4x4 tile d and weights g, A^T [(2G) g (2G)^T . B^T d B] A
    is 4x the 2x2 direct sums, so the kernel's shift by 2 is exact (Lavin and Gray's F(2x2, 3x3))."""
    gen = torch.Generator().manual_seed(14)
    g = torch.randint(-128, 128, (5, 3, 3, 3), generator=gen, dtype=torch.int8)
    d = torch.randint(-127, 128, (3, 4, 4), generator=gen, dtype=torch.int64)
    layout = transformed_weight(g)  # (16, 1, 8 pairs, 16 outputs, 2 inputs)
    u = layout.permute(0, 1, 3, 2, 4).reshape(16, 16, 16)[:, :5, :3].to(torch.int64)  # (points, outputs, inputs)
    bt = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
    at = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]])
    v = torch.einsum("ai,cij,bj->abc", bt, d, bt).reshape(16, 3)  # (points, inputs)
    m = torch.einsum("pkc,pc->pk", u, v).reshape(4, 4, 5)
    y = torch.einsum("ai,ijk,bj->kab", at, m, at)
    direct = torch.nn.functional.conv2d(d.unsqueeze(0).double(), g.double()).squeeze(0).round().to(torch.int64)
    assert torch.equal(y, 4 * direct)
    assert int(layout.abs().max()) <= 9 * 128

"""The onednn backend's depthwise 3x3 convs on fxquant's AVX2 loop (``fxquant.kernels.onednn.depthwise``) against
oneDNN's own conv primitive, built by fxquant for the same layer: the same bytes, with and without ReLU, at stride 1
and 2, padding 0 and 1, across channel counts, sizes, batches and thread counts, the input zero point folded or not,
with the loop seen to run; the calls it leaves to the primitive; the one weight copy it keeps.

The loop runs where AVX2 is the highest instruction set fxquant may use: CPUs with AVX2 alone, or
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
from fxquant.kernels.base import ConvSpec, PackedWeight
from fxquant.kernels.onednn import depthwise as onednn_depthwise
from fxquant.kernels.onednn.weights import operands
from fxquant.kernels.registry import get_backend
from fxquant.qparams import QParams

pytestmark = ONEDNN_PRIMITIVES

OUT_QP = QParams(torch.tensor(0.093), torch.tensor(9), 0, 127)  # a 7-bit output, as convert gives without VNNI
# (batch, channels, height, width, stride, padding): MobileNetV2's layers at both strides, odd sizes, a row of one,
# no padding, eight channels alone, a batch of three
GEOMETRIES = [(1, 144, 56, 56, 1, 1), (1, 96, 112, 112, 2, 1), (2, 24, 9, 7, 1, 1), (1, 40, 7, 8, 2, 1),
              (3, 8, 5, 5, 1, 0), (1, 16, 1, 6, 1, 1), (1, 32, 10, 9, 2, 0), (1, 960, 7, 7, 1, 1)]


def _layer(geometry: tuple[int, ...], per_channel: bool, bias: bool, seed: int,
           qrange: tuple[int, int] = (0, 127)) -> tuple[Layer, ConvSpec]:
    n, c, h, w, stride, pad = geometry
    layer = make_layer((n, c, h, w), (c, 1, 3, 3), qrange=qrange, per_channel=per_channel, bias=bias, seed=seed)
    return layer, ConvSpec(2, (stride, stride), (pad, pad), (1, 1), c)


def _conv(layer: Layer, spec: ConvSpec, *, relu: bool, folded: bool = True) -> tuple[torch.Tensor, PackedWeight]:
    """The layer's conv on the onednn backend, and its packed weight. ``folded``: packed with the input's qparams
    (an unpadded conv then folds the input zero point into its bias)."""
    onednn = get_backend("onednn")
    in_qp = layer.in_qp if folded else QParams(layer.in_qp.scale * 2, layer.in_qp.zero_point, layer.in_qp.qmin,
                                                layer.in_qp.qmax)
    packed: PackedWeight = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=in_qp)
    a = layer.q_x.contiguous(memory_format=torch.channels_last)
    return onednn.conv(a, packed, layer.in_qp, OUT_QP, relu=relu), packed


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize(("per_channel", "bias", "relu"), [(True, True, True), (False, False, False),
                                                           (True, False, False)])
def test_the_loop_gives_the_primitives_bytes(monkeypatch: pytest.MonkeyPatch, geometry: tuple[int, ...],
                                             per_channel: bool, bias: bool, relu: bool) -> None:
    """uint8 results bit for bit against oneDNN's conv primitive on the same layer: the integer sums are oneDNN's and
    so is the requantization."""
    require_avx2_alone("depthwise convs")
    layer, spec = _layer(geometry, per_channel, bias, seed=sum(geometry))
    calls = count_calls(monkeypatch, "dwconv3x3_onednn")
    with loop_threads(onednn_depthwise.FAMILY):
        mine, packed = _conv(layer, spec, relu=relu)
        with declined(monkeypatch, onednn_depthwise, "depthwise_call"):
            theirs, primitive = _conv(layer, spec, relu=relu)
    assert calls == [1], "the depthwise loop did not run: the test would compare the primitive with itself"
    assert packed.payload.depthwise is not None and primitive.payload.depthwise is None
    assert mine.shape == theirs.shape and mine.is_contiguous(memory_format=torch.channels_last)
    assert int(mine.max()) > int(OUT_QP.zero_point) and int(mine.min()) < 127, "a saturated output hides the sums"
    assert torch.equal(mine, theirs), f"{int((mine.int() - theirs.int()).abs().max())} steps apart"


@pytest.mark.parametrize("folded", [True, False])
def test_the_input_zero_point_folded_or_not(monkeypatch: pytest.MonkeyPatch, folded: bool) -> None:
    """An unpadded conv packed for its input's qparams folds the zero point into the bias (the loop's offset is then
    zero); packed for others, the loop subtracts it itself: the primitive's bytes both ways."""
    require_avx2_alone("depthwise convs")
    layer, spec = _layer((2, 48, 10, 11, 1, 0), per_channel=True, bias=True, seed=5)
    assert int(layer.in_qp.zero_point) != 0
    calls = count_calls(monkeypatch, "dwconv3x3_onednn")
    with loop_threads(onednn_depthwise.FAMILY):
        mine, packed = _conv(layer, spec, relu=True, folded=folded)
        with declined(monkeypatch, onednn_depthwise, "depthwise_call"):
            theirs, _ = _conv(layer, spec, relu=True, folded=folded)
    assert (operands(packed.payload, layer.in_qp)[1] == 0) == folded  # the zero point the call passes
    assert calls == [1]
    assert torch.equal(mine, theirs)


def test_the_bytes_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread and two (its limit) give the same bytes: each output is one thread's, summed in one order."""
    require_avx2_alone("depthwise convs")
    layer, spec = _layer((2, 192, 28, 28, 1, 1), per_channel=True, bias=True, seed=10)
    calls = count_calls(monkeypatch, "dwconv3x3_onednn")
    outs = at_thread_counts(onednn_depthwise.FAMILY, lambda: _conv(layer, spec, relu=True)[0])
    assert len(calls) == 2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("case", ["5x5", "dilation 2", "two channels per group", "channel multiplier 2",
                                  "12 channels", "padding 2", "stride (1, 2)", "8-bit inputs", "float output",
                                  "fused hardswish", "above the thread limit"])
def test_the_primitive_keeps_what_the_loop_does_not_take(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Geometries the loop does not compute, 8-bit inputs (where it was not measured against oneDNN's kernel),
    outputs other than uint8 with a ReLU, and thread counts above its limit go to oneDNN's primitive."""
    require_avx2_alone("depthwise convs")
    c = 12 if case == "12 channels" else 16
    kernel = 5 if case == "5x5" else 3
    groups = c // 2 if case == "two channels per group" else c
    out_channels = 2 * c if case == "channel multiplier 2" else c
    in_channels = c
    stride = {"stride (1, 2)": (1, 2)}.get(case, (1, 1))
    spec = ConvSpec(2, stride, (2, 2) if case == "padding 2" else (1, 1), (2, 2) if case == "dilation 2" else (1, 1),
                    groups)
    layer = make_layer((1, in_channels, 9, 9), (out_channels, in_channels // groups, kernel, kernel),
                       qrange=(0, 255) if case == "8-bit inputs" else (0, 127), per_channel=True, bias=True, seed=11)
    onednn = get_backend("onednn")
    calls = count_calls(monkeypatch, "dwconv3x3_onednn")
    previous = torch.get_num_threads()
    torch.set_num_threads(native.THREAD_LIMITS[onednn_depthwise.FAMILY] + 1 if case == "above the thread limit"
                          else 1)
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
    assert packed.payload.depthwise is None
    assert out.shape[:2] == (1, out_channels)

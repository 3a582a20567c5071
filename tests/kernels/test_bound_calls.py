"""How the oneDNN backend calls its ops: each layer's call is bound once per input shape, thread count and qparams
(a bound call must be the call it replaces, for every shape, qparams and output kind a weight meets, in any order),
and the input zero point of an unpadded conv or a Linear is folded into its bias. Inputs use the range the backend
declares on this CPU (7 bits without VNNI, where oneDNN's 16-bit pair sums saturate 8-bit inputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_contract_cases import (
    ConvCase,
    activation_range,
    conv_layer,
    float_conv,
    make_layer,
    output_qparams,
    zero_point_in,
)

from fxquant.kernels.base import ConvAddQParams, ConvSpec, PackedWeight
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.qparams import QParams

pytestmark = [pytest.mark.skipif("onednn" not in available_backends(), reason="torch.ops.onednn int8 ops missing"),
              pytest.mark.usefixtures("onednn_path")]  # its own primitives and the torch ops

# Strided along the width: an input three columns wide gives a one-column output, which raw oneDNN gets wrong
# (test_onednn_backend.py), so that shape needs the workaround and the others must not get it.
_SPEC = ConvSpec(2, (1, 2), (0, 0), (1, 1), 1)
_SIZES = [(7, 9), (7, 3), (9, 6)]


def _input_qp(scale: torch.Tensor, eight_bit_zero_point: int) -> QParams:
    """Input qparams on oneDNN's declared range, the zero point where ``eight_bit_zero_point`` is on 0..255."""
    qrange = activation_range("onednn")
    return QParams(scale, torch.tensor(zero_point_in(qrange, eight_bit_zero_point)), *qrange)


def _fresh(spec: ConvSpec, weights: tuple[torch.Tensor, QParams, torch.Tensor | None],
           in_qp: QParams) -> PackedWeight:
    return get_backend("onednn").prepack_conv(*weights, spec, in_qp=in_qp)


def test_a_conv_weight_bound_for_many_shapes_gives_each_shape_its_own_result() -> None:
    """One packed weight called with inputs of several shapes (twice each, interleaved, both output qparams) equals a
    freshly packed weight called once per input: no call is reused for another shape or output."""
    onednn = get_backend("onednn")
    layer = conv_layer(ConvCase(_SPEC, 1, 5, 7, (2, 2), (7, 9), True, True, False), activation_range(onednn), 0)
    weights = (layer.q_w, layer.w_qp, layer.bias)
    shared = _fresh(_SPEC, weights, layer.in_qp)
    outputs = [output_qparams(float_conv(layer, _SPEC)), QParams(torch.tensor(0.5), torch.tensor(7), 0, 255)]
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, layer.in_qp.qmax + 1, (batch, 5, *size), generator=gen, dtype=torch.uint8)
              for size in _SIZES for batch in (1, 3)]
    for _ in range(2):
        for a in inputs:
            for out_qp in outputs:
                for relu in (False, True):
                    got = onednn.conv(a, shared, layer.in_qp, out_qp, relu=relu)
                    want = onednn.conv(a, _fresh(_SPEC, weights, layer.in_qp), layer.in_qp, out_qp, relu=relu)
                    assert torch.equal(got, want), (tuple(a.shape), out_qp.scalar(), relu)
                float_out = onednn.conv_to_float(a, shared, layer.in_qp, outputs[0], relu=False)
                assert float_out.dtype == torch.float32
    assert len(shared.payload.calls) <= 16  # bounded: later shapes are built per call, not kept


def test_bound_conv1d_and_narrow_range_match_the_reference() -> None:
    """conv1d (run as a conv2d over a height of one) and a 7-bit output range (clamped after the op) through the
    bound calls, against the reference backend's integer arithmetic."""
    onednn, ref = get_backend("onednn"), get_backend("reference")
    spec = ConvSpec(1, (2,), (1,), (1,), 1)
    layer = conv_layer(ConvCase(spec, 2, 4, 6, (3,), (17,), False, True, True), activation_range(onednn), 3)
    out_qp = output_qparams(float_conv(layer, spec))
    narrow = QParams(out_qp.scale * 2, torch.tensor(60), 0, 127)
    for qp in (out_qp, narrow):
        packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
        ref_packed = ref.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
        for _ in range(2):
            got = onednn.conv(layer.q_x, packed, layer.in_qp, qp, relu=True)
            want = ref.conv(layer.q_x, ref_packed, layer.in_qp, qp, relu=True)
            assert got.shape == want.shape and int(got.max()) <= qp.qmax
            assert int((got.int() - want.int()).abs().max()) <= 1


def test_bound_linear_keeps_outputs_apart() -> None:
    """A linear weight called for a uint8 result, a float result and under two output qparams, interleaved."""
    onednn = get_backend("onednn")
    layer = make_layer((3, 16), (5, 16), qrange=activation_range(onednn), per_channel=True, bias=True, seed=2)
    packed = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
    first = QParams(torch.tensor(0.05), torch.tensor(128), 0, 255)
    second = QParams(torch.tensor(0.2), torch.tensor(9), 0, 255)
    for _ in range(2):
        for qp in (first, second):
            fresh = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
            assert torch.equal(onednn.linear(layer.q_x, packed, layer.in_qp, qp, relu=False),
                               onednn.linear(layer.q_x, fresh, layer.in_qp, qp, relu=False))
        as_float = onednn.linear_to_float(layer.q_x, packed, layer.in_qp, first, relu=False)
        assert as_float.dtype == torch.float32
        rounded = onednn.linear(layer.q_x, packed, layer.in_qp, first, relu=False)
        assert int((onednn.quantize(as_float, first).int() - rounded.int()).abs().max()) <= 1


def test_bound_conv_add_matches_conv_then_add() -> None:
    """The fused conv + add, bound per input and accum shape, against the conv and the add run separately (within
    one step: the fused kernel rounds once), for a shape it fuses and one it runs unfused (one output column)."""
    onednn = get_backend("onednn")
    spec = ConvSpec(2, (1, 2), (0, 0), (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 1, 4, 4, (1, 3), (5, 9), False, True, False), activation_range(onednn), 4)
    conv_qp = output_qparams(float_conv(layer, spec))
    accum_qp = QParams(torch.tensor(0.04), torch.tensor(100), 0, 255)
    sum_qp = QParams(torch.tensor(0.08), torch.tensor(90), 0, 255)
    qps = ConvAddQParams(layer.in_qp, conv_qp, accum_qp, sum_qp)
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    for width in (9, 3, 9):  # 3: a one-column output, unfused
        a = layer.q_x[..., :width].contiguous()
        conv = onednn.conv(a, packed, layer.in_qp, conv_qp, relu=False)
        accum = torch.randint(0, 256, conv.shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        want = onednn.add(conv, accum, conv_qp, accum_qp, sum_qp, relu=True)
        got = onednn.conv_add(a, packed, accum.clone(), qps, relu=True)
        assert got.shape == want.shape
        assert int((got.int() - want.int()).abs().max()) <= 1


def test_a_deep_copy_binds_its_own_calls() -> None:
    """Copies share the packed weight but get fresh qparams objects: each binds its own calls (a shared cache would
    fill up with the copies' keys), and both compute the same result."""
    import copy

    onednn = get_backend("onednn")
    layer = make_layer((2, 16), (4, 16), qrange=activation_range(onednn), per_channel=True, bias=True, seed=5)
    out_qp = QParams(torch.tensor(0.05), torch.tensor(128), 0, 255)
    packed = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
    want = onednn.linear(layer.q_x, packed, layer.in_qp, out_qp, relu=False)
    copied, in_copy, out_copy = copy.deepcopy((packed, layer.in_qp, out_qp))
    assert copied.payload.calls == {} and copied.payload.packed is packed.payload.packed
    assert torch.equal(onednn.linear(layer.q_x, copied, in_copy, out_copy, relu=False), want)
    assert len(packed.payload.calls) == 1 and len(copied.payload.calls) == 1


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("kernel", "padding", "folds"), [((1, 1), (0, 0), True), ((3, 3), (0, 0), True),
                                                          ((3, 3), (1, 1), False)])
def test_an_unpadded_conv_folds_the_input_zero_point_into_the_bias(bias: bool, kernel: tuple[int, int],
                                                                   padding: tuple[int, int], folds: bool) -> None:
    """``conv(q - z) = conv(q) - z * sum(w)`` for every output of an unpadded conv: the op then runs without an input
    zero point (3.5x faster on a 320 -> 1280 1x1 conv); within one step of the reference's integer arithmetic."""
    onednn, ref = get_backend("onednn"), get_backend("reference")
    spec = ConvSpec(2, (2, 1), padding, (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 2, 6, 10, kernel, (9, 7), True, bias, False), activation_range(onednn), 6)
    in_qp = _input_qp(layer.in_qp.scale, 201)  # far from 0: a large correction
    out_qp = output_qparams(float_conv(dataclasses.replace(layer, in_qp=in_qp), spec))
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=in_qp)
    assert (packed.payload.folded is not None) is folds
    ref_packed = ref.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=in_qp)
    for relu in (False, True):
        got = onednn.conv(layer.q_x, packed, in_qp, out_qp, relu=relu)
        want = ref.conv(layer.q_x, ref_packed, in_qp, out_qp, relu=relu)
        assert int((got.int() - want.int()).abs().max()) <= 1


def test_a_conv_called_under_two_thread_counts_gets_a_weight_packed_for_each(onednn_path: str) -> None:
    """oneDNN picks the weight layout (and a primitive its thread partitioning) by thread count: a weight packed under
    two threads and run under one is reordered on every call (MobileNetV2 at batch 1: 43 against 9 ms). Each thread
    count gets its own packing or primitive and bound call, and the results are the same."""
    onednn = get_backend("onednn")
    layer = conv_layer(ConvCase(_SPEC, 1, 5, 7, (2, 2), (7, 9), True, True, False), activation_range(onednn), 7)
    out_qp = output_qparams(float_conv(layer, _SPEC))
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, _SPEC, in_qp=layer.in_qp)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            results.append(onednn.conv(layer.q_x, packed, layer.in_qp, out_qp, relu=False))
    finally:
        torch.set_num_threads(before)
    if onednn_path == "torch_ops":
        assert sorted(threads for _, threads in packed.payload.by_shape) == [1, 2]
    assert len(packed.payload.calls) == 2
    assert all(torch.equal(result, results[0]) for result in results)



def test_a_linear_folds_the_input_zero_point_it_is_packed_for() -> None:
    """A Linear packed for its input qparams runs without the zero point (BERT's FFN: 5.1 against 6.4 ms); called with
    other qparams it uses the real zero point and bias. Both within one step of the reference."""
    onednn, ref = get_backend("onednn"), get_backend("reference")
    layer = make_layer((6, 40), (9, 40), qrange=activation_range(onednn), per_channel=True, bias=True, seed=8)
    in_qp, other = _input_qp(layer.in_qp.scale, 177), _input_qp(layer.in_qp.scale * 1.5, 30)
    out_qp = QParams(torch.tensor(0.3), torch.tensor(120), 0, 255)
    packed = onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias, in_qp=in_qp)
    assert packed.payload.folded is not None
    ref_packed = ref.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
    for qp in (in_qp, other, in_qp):
        got = onednn.linear(layer.q_x, packed, qp, out_qp, relu=False)
        want = ref.linear(layer.q_x, ref_packed, qp, out_qp, relu=False)
        assert int((got.int() - want.int()).abs().max()) <= 1, qp.scalar()
        as_float = onednn.linear_to_float(layer.q_x, packed, qp, out_qp, relu=False)
        assert float((as_float - ref.linear_to_float(layer.q_x, ref_packed, qp, out_qp, relu=False)).abs().max()) \
            <= float(out_qp.scale)


def test_a_conv_called_with_other_input_qparams_than_it_was_packed_for() -> None:
    """The folded bias belongs to one input zero point: other input qparams get the real zero point and bias."""
    onednn, ref = get_backend("onednn"), get_backend("reference")
    spec = ConvSpec(2, (1, 1), (0, 0), (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 1, 4, 5, (1, 1), (6, 6), True, True, False), activation_range(onednn), 9)
    in_qp, other = (_input_qp(layer.in_qp.scale, zp) for zp in (150, 20))
    out_qp = output_qparams(float_conv(dataclasses.replace(layer, in_qp=in_qp), spec))
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=in_qp)
    ref_packed = ref.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=in_qp)
    for qp in (other, in_qp):
        got = onednn.conv(layer.q_x, packed, qp, out_qp, relu=False)
        want = ref.conv(layer.q_x, ref_packed, qp, out_qp, relu=False)
        assert int((got.int() - want.int()).abs().max()) <= 1, qp.scalar()


def test_no_fold_where_the_uncentered_sum_could_leave_int32() -> None:
    """oneDNN's own zero-point correction is exact in wrapping int32 whenever the centered sum fits; a folded zero
    point is subtracted in float after the int32 sum, so rows whose ``sum(|w|) * 255`` passes 2^31 keep it."""
    onednn = get_backend("onednn")
    in_qp = QParams(torch.tensor(0.01), torch.tensor(128), 0, 255)
    w_qp = QParams(torch.tensor(0.01), torch.tensor(0), -128, 127)
    short, long = (torch.full((2, k), -128, dtype=torch.int8) for k in (65_000, 66_000))  # 255 * 128 * k vs 2^31
    assert onednn.prepack_linear(short, w_qp, None, in_qp=in_qp).payload.folded is not None
    assert onednn.prepack_linear(long, w_qp, None, in_qp=in_qp).payload.folded is None

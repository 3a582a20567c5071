"""Known traps of the quantized-dtype backends, each pinned by a test.

fbgemm's depthwise conv kernel (3x3 / 3x3x3, padding 1) sums pairs of u8*s8 products in 16 bits
(``vpmaddubsw``): 255 * 127 * 2 = 64770 saturates at 32767. ``activation_qrange(feeds_grouped_conv=True)`` gives
activations 7 bits (127 * 127 * 2 = 32258 fits), which every backend must survive on worst-case inputs.

fbgemm's direct transposed-conv kernel (torch 2.13) writes input rows to the wrong output rows; the condition under
which fbgemm picks it is pinned below, and ``test_transposed_and_fixed_range.py`` checks that fxquant's fbgemm
backend never reaches it (those cases fail against the reference when the workaround is removed).
"""

from __future__ import annotations

import pytest
import torch
from kernel_contract_cases import (
    ConvCase,
    Layer,
    backends_under_test,
    conv_layer,
    conv_supported,
    float_conv,
    output_qparams,
    reference_backend,
    run_conv,
    steps,
)

from fxquant.kernels.base import Backend, ConvSpec
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.kernels.torch_engines.engine import quantized_engine
from fxquant.kernels.torch_engines.transposed import direct_conv_path
from fxquant.qparams import REDUCED_UINT8_RANGE, QParams

needs_fbgemm = pytest.mark.skipif("fbgemm" not in available_backends(), reason="fbgemm not in this torch build")


def _worst_case_depthwise(dim: int, qrange: tuple[int, int], weight_value: int) -> tuple[Layer, ConvSpec]:
    """Every activation at the top of ``qrange`` and every weight at ``weight_value``: the largest pair sums."""
    channels = 16
    spec = ConvSpec(dim, (1,) * dim, (1,) * dim, (1,) * dim, channels)
    q_x = torch.full((1, channels, *([6] * dim)), qrange[1], dtype=torch.uint8)
    q_w = torch.full((channels, 1, *([3] * dim)), weight_value, dtype=torch.int8)
    in_qp = QParams(torch.tensor(0.02), torch.tensor(qrange[0]), *qrange)
    w_qp = QParams(torch.tensor(0.01), torch.tensor(0), -128, 127)
    return Layer(q_x, in_qp, q_w, w_qp, None), spec


def _worst_case_lsb(backend: Backend, dim: int, qrange: tuple[int, int], weight_value: int) -> int:
    layer, spec = _worst_case_depthwise(dim, qrange, weight_value)
    out_qp = output_qparams(float_conv(layer, spec))
    got = run_conv(backend, layer, spec, out_qp, relu=False)
    return steps(got, run_conv(reference_backend(), layer, spec, out_qp, relu=False), out_qp)


@pytest.mark.parametrize(("name", "dim"), [(n, d) for n in backends_under_test() for d in (2, 3)
                                           if conv_supported(get_backend(n), d)])
@pytest.mark.parametrize("weight_value", [127, -128])
def test_depthwise_worst_case_within_one_step_with_the_backends_qrange(name: str, dim: int,
                                                                      weight_value: int) -> None:
    backend = get_backend(name)
    qrange = backend.activation_qrange(feeds_grouped_conv=True)
    lsb = _worst_case_lsb(backend, dim, qrange, weight_value)
    assert lsb <= 1, f"{name} depthwise conv{dim}d is {lsb} LSB off with activations in {qrange}"


@needs_fbgemm
def test_fbgemm_gives_grouped_conv_inputs_seven_bits() -> None:
    assert get_backend("fbgemm").activation_qrange(feeds_grouped_conv=True) == REDUCED_UINT8_RANGE


@needs_fbgemm
@pytest.mark.parametrize("dim", [2, 3])
def test_fbgemm_depthwise_saturates_with_full_range_activations(dim: int) -> None:
    """Why the 7-bit range exists. If this starts failing, fbgemm stopped saturating and the range can widen."""
    lsb = _worst_case_lsb(get_backend("fbgemm"), dim, (0, 255), 127)
    assert lsb > 10, f"fbgemm depthwise conv{dim}d with [0, 255] inputs is only {lsb} LSB off: no saturation"


@pytest.mark.skipif("qnnpack" not in available_backends(), reason="qnnpack not in this torch build")
def test_qnnpack_conv_output_is_channels_last_and_relu_reads_it_right() -> None:
    qnnpack, ref = get_backend("qnnpack"), reference_backend()
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 2, 3, 5, (3, 3), (6, 7), False, True, False), (0, 255), 0)
    out_qp = output_qparams(float_conv(layer, spec))
    packed = qnnpack.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    y = qnnpack.conv(qnnpack.quantize(layer.x, layer.in_qp), packed, layer.in_qp, out_qp, relu=False)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    ref_packed = ref.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    want = ref.relu(ref.conv(layer.q_x, ref_packed, layer.in_qp, out_qp, relu=False), out_qp)
    got = qnnpack.dequantize(qnnpack.relu(y, out_qp), out_qp)
    assert steps(got, ref.dequantize(want, out_qp), out_qp) <= 1


def _raw_fbgemm_transposed_lsb(cin: int, cout: int, kernel: tuple[int, int], stride: tuple[int, int],
                               padding: int) -> int:
    """torch's own fbgemm transposed conv (no fxquant workaround) against float64, in output steps."""
    gen = torch.Generator().manual_seed(cin + cout + sum(kernel))
    w = torch.quantize_per_tensor(torch.randn(cin, cout, *kernel, generator=gen), 0.02, 0, torch.qint8)
    x = torch.quantize_per_tensor(torch.rand(2, cin, 5, 6, generator=gen), 0.01, 3, torch.quint8)
    ref = torch.nn.functional.conv_transpose2d(x.dequantize().double(), w.dequantize().double(), None, stride,
                                               padding)
    scale = float(ref.abs().max()) / 100
    with quantized_engine("fbgemm"):
        packed = torch.ops.quantized.conv_transpose2d_prepack(w, None, list(stride), [padding] * 2, [0, 0], [1, 1], 1)
        out = torch.ops.quantized.conv_transpose2d(x, packed, scale, 128)
    return int(((out.dequantize().double() - ref).abs() / scale).max().round())


_TRANSPOSED_GRID = [(cin, cout, kernel, stride, padding) for cin in (8, 12) for cout in (8, 4)
                    for kernel in ((2, 2), (2, 6), (2, 7), (3, 2)) for stride in ((2, 2), (1, 2), (3, 1))
                    for padding in (0, 1) if padding < min(kernel)]


@needs_fbgemm
def test_fbgemm_direct_transposed_kernel_is_wrong_exactly_where_fxquant_avoids_it() -> None:
    """Pins the condition in ``fbgemm_transposed.direct_conv_path``: if a torch upgrade fixes the kernel (or moves
    the condition), this fails and the workaround can be revisited."""
    mismatches = []
    for cin, cout, kernel, stride, padding in _TRANSPOSED_GRID:
        spec = ConvSpec(2, stride, (padding, padding), (1, 1), 1, True, (0, 0))
        wrong = _raw_fbgemm_transposed_lsb(cin, cout, kernel, stride, padding) > 1
        if wrong != direct_conv_path(torch.empty(cin, cout, *kernel), spec):
            mismatches.append((cin, cout, kernel, stride, padding, wrong))
    assert not mismatches, f"raw fbgemm correctness differs from the predicted condition: {mismatches}"

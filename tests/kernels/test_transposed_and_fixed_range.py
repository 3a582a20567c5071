"""Transposed convs and the fixed-range functions (sigmoid, hardsigmoid, tanh): every backend within one output
step of the reference backend.

The transposed cases include the geometries where fbgemm's direct kernel is wrong in torch 2.13 (2-d, groups 1,
channels multiples of 8, kernel height 2, width <= 6, strides 1 or 2, no padding): a backend that hands them to that
kernel is 100+ steps off here. Inputs come both contiguous and channels-last (what a conv before them returns), in
the range the backend under test declares on this CPU (7 bits for fbgemm's grouped convs and without VNNI).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_contract_cases import (
    activation,
    activation_range,
    backends_under_test,
    output_qparams,
    reference_backend,
    steps,
)

from fxquant.kernels.base import Backend, ConvSpec
from fxquant.kernels.reference import fixed_range_table
from fxquant.kernels.registry import get_backend
from fxquant.passes.value_ops import FIXED_RANGES, fixed_qparams
from fxquant.qparams import INT8_RANGE, QParams, dequantize

BACKENDS = backends_under_test()
# (in, out, kernel, stride, padding, output_padding, groups, input size): U-Net upsamplers first
TRANSPOSED = [
    (32, 16, (2, 2), (2, 2), (0, 0), (0, 0), 1, (6, 5)),
    (16, 8, (2, 2), (2, 2), (0, 0), (1, 1), 1, (4, 4)),
    (16, 16, (2, 3), (1, 2), (0, 0), (0, 0), 1, (5, 6)),
    (8, 8, (2, 1), (2, 1), (0, 0), (0, 0), 1, (3, 4)),
    (16, 8, (3, 3), (2, 2), (1, 1), (1, 1), 1, (5, 5)),
    (12, 8, (2, 2), (2, 2), (0, 0), (0, 0), 1, (4, 3)),
    (16, 16, (3, 3), (1, 1), (1, 1), (0, 0), 2, (4, 5)),
    (8, 16, (4,), (4,), (0,), (0,), 1, (7,)),
    (8, 4, (3,), (2,), (1,), (1,), 1, (9,)),
]


def _transposed_case(case: tuple, seed: int, qrange: tuple[int, int]) -> tuple[torch.Tensor, QParams, torch.Tensor,
                                                                               QParams, torch.Tensor, ConvSpec]:
    cin, cout, kernel, stride, padding, output_padding, groups, size = case
    gen = torch.Generator().manual_seed(seed)
    q_x, in_qp = activation((2, cin, *size), qrange, gen)
    q_w = torch.randint(INT8_RANGE[0], INT8_RANGE[1] + 1, (cin, cout // groups, *kernel), generator=gen,
                        dtype=torch.int64).to(torch.int8)
    w_qp = QParams(torch.tensor(0.004), torch.tensor(0), *INT8_RANGE)
    spec = ConvSpec(len(kernel), stride, padding, (1,) * len(kernel), groups, True, output_padding)
    return q_x, in_qp, q_w, w_qp, torch.randn(cout, generator=gen), spec


def _run_transposed(backend: Backend, case: tuple, out_qp: QParams | None, channels_last: bool,
                    qrange: tuple[int, int]) -> torch.Tensor:
    q_x, in_qp, q_w, w_qp, bias, spec = _transposed_case(case, 7, qrange)
    x = dequantize(q_x, in_qp)
    if out_qp is None:  # the float result, to size the output qparams
        conv = F.conv_transpose1d if spec.dim == 1 else F.conv_transpose2d
        return conv(x.double(), dequantize(q_w, w_qp).double(), bias.double(), spec.stride, spec.padding,
                    spec.output_padding, spec.groups)
    a = backend.quantize(x, in_qp)
    if channels_last and a.dim() == 4:
        a = a.contiguous(memory_format=torch.channels_last)
    packed = backend.prepack_conv_transpose(q_w, w_qp, bias, spec)
    return backend.dequantize(backend.conv_transpose(a, packed, in_qp, out_qp), out_qp)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", TRANSPOSED, ids=[str(c[:4]) for c in TRANSPOSED])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_transpose_matches_reference(name: str, case: tuple, channels_last: bool) -> None:
    qrange = activation_range(name, grouped=case[6] > 1)
    out_qp = output_qparams(_run_transposed(reference_backend(), case, None, False, qrange))
    got = _run_transposed(get_backend(name), case, out_qp, channels_last, qrange)
    want = _run_transposed(reference_backend(), case, out_qp, False, qrange)
    assert got.shape == want.shape
    lsb = steps(got, want, out_qp)
    assert lsb <= 1, f"{name} conv_transpose {case} is {lsb} LSB off the reference"


def _fixed(backend: Backend, function: str, qrange: tuple[int, int]) -> tuple[torch.Tensor, QParams]:
    q, qa = activation((3, 5, 17), qrange, torch.Generator().manual_seed(len(function) + qrange[1]))
    qa = QParams(torch.tensor(0.06), qa.zero_point, qa.qmin, qa.qmax)  # inputs over ~[-8, 8]: both tails saturate
    qout = fixed_qparams(function, qrange)
    out = backend.fixed_range(backend.quantize(dequantize(q, qa), qa), function, qa, qout)
    return backend.dequantize(out, qout), qout


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("function", sorted(FIXED_RANGES))
@pytest.mark.parametrize("qrange", [(0, 255), (0, 127)])
def test_fixed_range_function_matches_reference(name: str, function: str, qrange: tuple[int, int]) -> None:
    got, qout = _fixed(get_backend(name), function, qrange)
    want, _ = _fixed(reference_backend(), function, qrange)
    assert steps(got, want, qout) <= 1, f"{name} {function} is {steps(got, want, qout)} LSB off"


@pytest.mark.parametrize("function", sorted(FIXED_RANGES))
def test_reference_fixed_range_rounds_the_float64_function_once(function: str) -> None:
    """The reference table against the function computed independently, level by level."""
    qa = QParams(torch.tensor(0.05), torch.tensor(131), 0, 255)
    qout = fixed_qparams(function, (0, 255))
    fn = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardsigmoid": F.hardsigmoid}[function]
    levels = torch.arange(256)
    expected = torch.clamp(torch.round(fn((levels - 131).double() * 0.05) / float(qout.scale)) + int(qout.zero_point),
                           0, 255)
    assert torch.equal(fixed_range_table(function, qa, qout).long(), expected.long())
    lo, hi = FIXED_RANGES[function]
    assert dequantize(torch.tensor([0]), qout).item() == lo  # the range's bottom is exact: 0 for sigmoid, -1 tanh
    assert hi - float(qout.scale) == dequantize(torch.tensor([255]), qout).item()

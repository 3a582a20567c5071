"""The reference backend against an independent float computation, and the exactness claims it rests on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernel_contract_cases import (
    CONTRACT,
    FLOAT_CONVS,
    ConvCase,
    activation,
    conv_cases,
    conv_layer,
    fake_quantized,
    float_conv,
    linear_shapes,
    make_layer,
    output_qparams,
    reference_backend,
    run_conv,
    run_linear,
    steps,
)

import fxquant.kernels.reference as reference_module
from fxquant.errors import ConfigError
from fxquant.kernels.plain_int8 import requantize
from fxquant.kernels.reference import integer_conv, integer_linear
from fxquant.qparams import QParams, affine_qparams, dequantize, fake_quantize


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_conv_matches_float_conv_then_fake_quant(dim: int) -> None:
    @CONTRACT
    @given(case=conv_cases(dim), seed=st.integers(0, 2**16))
    def check(case: ConvCase, seed: int) -> None:
        layer = conv_layer(case, (0, 255), seed)
        y = float_conv(layer, case.spec)
        out_qp = output_qparams(y)
        got = run_conv(reference_backend(), layer, case.spec, out_qp, relu=case.relu)
        lsb = steps(got, fake_quantized(y, out_qp, relu=case.relu), out_qp)
        assert lsb <= 1, f"reference conv is {lsb} LSB away from float for {case}"

    check()


@CONTRACT
@given(shape=linear_shapes(), per_channel=st.booleans(), bias=st.booleans(), relu=st.booleans(),
       seed=st.integers(0, 2**16))
def test_linear_matches_float_linear_then_fake_quant(shape: tuple[tuple[int, ...], int, int], per_channel: bool,
                                                     bias: bool, relu: bool, seed: int) -> None:
    lead, k, n = shape
    layer = make_layer((*lead, k), (n, k), qrange=(0, 255), per_channel=per_channel, bias=bias, seed=seed)
    y = F.linear(layer.x.double(), layer.w.double(), None if layer.bias is None else layer.bias.double())
    out_qp = output_qparams(y)
    got = run_linear(reference_backend(), layer, out_qp, relu=relu)
    assert steps(got, fake_quantized(y, out_qp, relu=relu), out_qp) <= 1


@pytest.mark.parametrize(("rows", "k", "n"), [(5, 1, 7), (17, 2, 3), (1, 1024, 64), (2, 2**17, 3)])
def test_integer_linear_is_exact(rows: int, k: int, n: int) -> None:
    """Both paths (int32 ``_int_mm`` and float64, used for K == 1 and for K >= 2**17) against int64 arithmetic."""
    gen = torch.Generator().manual_seed(k)
    a = torch.randint(0, 256, (rows, k), generator=gen).to(torch.uint8)
    w = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    want = (a.long() - 77) @ w.long().t()
    assert torch.equal(integer_linear(a, 77, w).long(), want)


@pytest.mark.parametrize("dim", [1, 2, 3])
def test_depthwise_taps_equal_float64_conv_exactly(dim: int) -> None:
    """The tap-by-tap depthwise path must give the very integers of PyTorch's float64 grouped conv."""

    @CONTRACT
    @given(case=conv_cases(dim), seed=st.integers(0, 2**16))
    def check(case: ConvCase, seed: int) -> None:
        spec = case.spec
        depthwise = ConvCase(spec, case.batch, spec.groups, case.out_channels, case.kernel, case.size, *case.flags)
        layer = conv_layer(depthwise, (0, 255), seed)
        zero_point = int(layer.in_qp.zero_point)
        want = FLOAT_CONVS[dim](layer.q_x.double() - zero_point, layer.q_w.double(), None, spec.stride,
                                spec.padding, spec.dilation, spec.groups)
        assert torch.equal(integer_conv(layer.q_x, zero_point, layer.q_w, spec), want)

    check()


def test_add_matches_float_add_then_fake_quant() -> None:
    ref = reference_backend()
    gen = torch.Generator().manual_seed(0)
    (q_a, qa), (q_b, qb) = activation((4, 9, 5), (0, 255), gen), activation((4, 9, 5), (0, 255), gen)
    total = dequantize(q_a, qa).double() + dequantize(q_b, qb).double()
    qout = affine_qparams(total.min().float(), total.max().float())
    for relu in (False, True):
        got = ref.dequantize(ref.add(q_a, q_b, qa, qb, qout, relu=relu), qout)
        assert steps(got, fake_quantized(total, qout, relu=relu), qout) <= 1


def test_pools_match_float_pools_then_fake_quant() -> None:
    ref = reference_backend()
    q, qp = activation((2, 3, 9, 7), (0, 255), torch.Generator().manual_seed(0))
    x = dequantize(q, qp).double()
    kwargs: dict[str, Any] = {"kernel_size": 3, "stride": 2, "padding": 1}
    assert steps(ref.dequantize(ref.avg_pool(q, qp, 2, kwargs), qp), fake_quantize(F.avg_pool2d(x, **kwargs), qp),
                 qp) <= 1
    pooled = ref.adaptive_avg_pool(q, qp, (2, 3))
    assert steps(ref.dequantize(pooled, qp), fake_quantize(F.adaptive_avg_pool2d(x, (2, 3)), qp), qp) <= 1


def test_requantize_rounds_half_to_even_clamps_and_fuses_relu() -> None:
    qp = QParams(torch.tensor(1.0), torch.tensor(10), 0, 127)
    acc = torch.tensor([-20.0, -0.5, 0.5, 1.5, 2.5, 500.0], dtype=torch.float64)
    assert requantize(acc, 1.0, qp, relu=False).tolist() == [0, 10, 10, 12, 12, 127]
    assert requantize(acc, 1.0, qp, relu=True).tolist() == [10, 10, 10, 12, 12, 127]


def test_relu_clamps_at_the_zero_point() -> None:
    qp = QParams(torch.tensor(0.1), torch.tensor(100), 0, 255)
    a = torch.tensor([0, 99, 100, 101, 255], dtype=torch.uint8)
    assert reference_backend().relu(a, qp).tolist() == [100, 100, 100, 101, 255]


@pytest.mark.parametrize(
    ("weight", "w_qp"),
    [
        (torch.zeros(2, 3), QParams(torch.tensor(0.1), torch.tensor(0), -128, 127)),
        (torch.zeros(2, 3, dtype=torch.int8), QParams(torch.tensor(0.1), torch.tensor(3), -128, 127)),
        (torch.zeros(2, 3, dtype=torch.int8), QParams(torch.ones(3), torch.zeros(3, dtype=torch.int64), -128, 127, 1)),
    ],
    ids=["float-weight", "asymmetric", "per-channel-axis-1"],
)
def test_unsupported_weights_are_rejected_with_a_fix(weight: torch.Tensor, w_qp: QParams) -> None:
    with pytest.raises(ConfigError, match="symmetric weight observer"):
        reference_backend().prepack_linear(weight, w_qp, None)


def test_outputs_are_plain_integer_tensors() -> None:
    layer = make_layer((3, 8), (4, 8), qrange=(0, 255), per_channel=True, bias=True, seed=0)
    ref = reference_backend()
    out_qp = QParams(torch.tensor(0.05), torch.tensor(3), 0, 255)
    out = ref.linear(ref.quantize(layer.x, layer.in_qp), ref.prepack_linear(layer.q_w, layer.w_qp, layer.bias),
                     layer.in_qp, out_qp, relu=False)
    assert out.dtype == torch.uint8 and not out.is_quantized


_KERNELS = Path(reference_module.__file__).parent
_PLAIN = ["reference.py", "plain_int8.py", *sorted(f"onednn/{p.name}" for p in (_KERNELS / "onednn").glob("*.py"))]


@pytest.mark.parametrize("module", _PLAIN)
def test_plain_backends_never_touch_quantized_dtypes(module: str) -> None:
    source = (_KERNELS / module).read_text()
    # quantized::max_pool2d is the exception: it takes plain uint8 (Inductor's PT2E lowering calls it so), no dtype
    source = source.replace("torch.ops.quantized.max_pool2d", "")
    for name in ("quint8", "qint8", "qint32", "quantize_per_tensor", "backends.quantized", "torch.ops.quantized"):
        assert name not in source, f"{module} uses {name}; only kernels/torch_engines/ may"

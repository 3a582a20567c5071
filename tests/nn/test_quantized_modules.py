"""Each INT8 module against integer arithmetic written here: within one output quantization step.

Inputs use the range each backend declares on this CPU, as convert does (7 bits where its kernels sum u8*s8 pairs
in 16 bits: fbgemm's grouped convs, fbgemm and oneDNN without VNNI)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fxquant.kernels.base import ConvSpec
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.nn import QuantizedAdd, QuantizedConv1d, QuantizedConv2d, QuantizedConv3d, QuantizedLinear
from fxquant.qparams import QParams, affine_qparams, dequantize, quantize, symmetric_qparams

BACKENDS = available_backends()
CONV = {1: (QuantizedConv1d, F.conv1d), 2: (QuantizedConv2d, F.conv2d), 3: (QuantizedConv3d, F.conv3d)}


def _int_output(backend: str, out: torch.Tensor, qp: QParams) -> torch.Tensor:
    return quantize(get_backend(backend).dequantize(out, qp), qp).long()


def _requantize(acc: torch.Tensor, in_qp: QParams, w_qp: QParams, out_qp: QParams, relu: bool,
                channel_dim: int) -> torch.Tensor:
    """int32 accumulator -> output ints: the formula every int8 kernel implements."""
    shape = [1] * acc.dim()
    shape[channel_dim] = -1
    multiplier = (in_qp.scale * w_qp.scale).double().reshape(shape) / out_qp.scale.double()
    out = torch.round(acc.double() * multiplier) + int(out_qp.zero_point)
    low = int(out_qp.zero_point) if relu else out_qp.qmin
    return out.clamp(low, out_qp.qmax).long()


def _operands(out_channels: int, in_shape: tuple[int, ...], weight_shape: tuple[int, ...], per_channel: bool,
              qrange: tuple[int, int]):
    x = torch.randn(*in_shape) * 2 + 0.5
    in_qp = affine_qparams(x.min(), x.max(), qrange)
    weight = torch.randn(*weight_shape) * 0.3
    if per_channel:
        lo, hi = torch.aminmax(weight.reshape(out_channels, -1), dim=1)
        w_qp = symmetric_qparams(lo, hi, axis=0)
    else:
        w_qp = symmetric_qparams(weight.min(), weight.max())
    bias = torch.randn(out_channels) * 0.1
    return x, in_qp, quantize(weight, w_qp), w_qp, bias


def _bias_int(bias: torch.Tensor, in_qp: QParams, w_qp: QParams) -> torch.Tensor:
    return torch.round(bias.double() / (in_qp.scale * w_qp.scale).double())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("relu", [True, False])
def test_linear_matches_integer_arithmetic(backend: str, per_channel: bool, relu: bool) -> None:
    qrange = get_backend(backend).activation_qrange(feeds_grouped_conv=False)
    x, in_qp, w_int, w_qp, bias = _operands(12, (5, 20), (12, 20), per_channel, qrange)
    x_int = quantize(x, in_qp).long() - int(in_qp.zero_point)
    acc = x_int.double() @ w_int.double().t() + _bias_int(bias, in_qp, w_qp)
    expected_fp = F.linear(dequantize(quantize(x, in_qp), in_qp), dequantize(w_int, w_qp), bias)
    out_qp = affine_qparams(expected_fp.min(), expected_fp.max())
    expected = _requantize(acc, in_qp, w_qp, out_qp, relu, channel_dim=1)
    module = QuantizedLinear(w_int, w_qp, bias, (in_qp, out_qp), relu=relu, backend=get_backend(backend))
    got = _int_output(backend, module(get_backend(backend).quantize(x, in_qp)), out_qp)
    diff = (got - expected).abs().max().item()
    assert diff <= 1, f"{backend}: max difference {diff} int8 steps"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dim", "groups", "stride", "padding", "dilation"), [
    (1, 1, 1, 1, 1), (2, 1, 2, 1, 1), (2, 3, 1, 0, 2), (2, 6, 1, 1, 1), (3, 1, 1, 1, 1)])
def test_conv_matches_integer_arithmetic(backend: str, dim: int, groups: int, stride: int, padding: int,
                                         dilation: int) -> None:
    module_cls, conv = CONV[dim]
    in_ch, out_ch, k = 6, 6 if groups == 6 else 9, 3
    qrange = get_backend(backend).activation_qrange(feeds_grouped_conv=groups > 1)  # 7 bits for fbgemm's grouped
    x, in_qp, w_int, w_qp, bias = _operands(out_ch, (2, in_ch) + (7,) * dim, (out_ch, in_ch // groups) + (k,) * dim,
                                            True, qrange)
    x_int = quantize(x, in_qp).long() - int(in_qp.zero_point)
    # float64 holds these integer sums exactly (|acc| < 2**53), so this is integer arithmetic
    acc = conv(x_int.double(), w_int.double(), None, stride, padding, dilation, groups)
    acc = acc + _bias_int(bias, in_qp, w_qp).reshape([1, -1] + [1] * dim)
    expected_fp = conv(dequantize(quantize(x, in_qp), in_qp), dequantize(w_int, w_qp), bias, stride, padding,
                       dilation, groups)
    out_qp = affine_qparams(expected_fp.min(), expected_fp.max())
    expected = _requantize(acc, in_qp, w_qp, out_qp, False, channel_dim=1)
    spec = ConvSpec(dim, (stride,) * dim, (padding,) * dim, (dilation,) * dim, groups)
    try:
        module = module_cls(spec, w_int, w_qp, bias, (in_qp, out_qp), relu=False, backend=get_backend(backend))
    except Exception as exc:  # a backend may lack a kernel for this geometry; it must say so clearly
        from fxquant.errors import BackendUnavailableError

        assert isinstance(exc, BackendUnavailableError), f"{backend}: {type(exc).__name__}: {exc}"
        return
    got = _int_output(backend, module(get_backend(backend).quantize(x, in_qp)), out_qp)
    diff = (got - expected).abs().max().item()
    assert diff <= 1, f"{backend} conv{dim}d groups={groups}: max difference {diff} int8 steps"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("relu", [True, False])
def test_add_with_different_scales_matches_float_reference(backend: str, relu: bool) -> None:
    a, b = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5) * 3
    qa, qb = affine_qparams(a.min(), a.max()), affine_qparams(b.min(), b.max())
    total = dequantize(quantize(a, qa), qa) + dequantize(quantize(b, qb), qb)
    if relu:
        total = total.relu()
    qout = affine_qparams(total.min(), total.max())
    expected = quantize(total, qout).long()
    kernel = get_backend(backend)
    module = QuantizedAdd(qa, qb, qout, relu=relu, backend=kernel)
    got = _int_output(backend, module(kernel.quantize(a, qa), kernel.quantize(b, qb)), qout)
    diff = (got - expected).abs().max().item()
    assert diff <= 1, f"{backend}: max difference {diff} int8 steps"

"""The reference backend: integer arithmetic in plain PyTorch, defining what every other backend must compute.

Activations are plain ``torch.uint8`` tensors. Linear and conv compute the exact integer accumulator
``sum((q_x - zp_x) * q_w)``, add the bias quantized like fbgemm does (``round(bias / (s_x * s_w))``), and requantize
once: ``clamp(round(acc * s_x * s_w / s_out) + zp_out, qmin, qmax)``; a fused ReLU clamps at ``zp_out``.

Why the accumulators are exact:

* linear uses ``torch._int_mm`` (int8 x int8 -> int32; on CPU it takes any shape). The uint8 activation is shifted
  to int8 by subtracting 128 and the shift is added back as ``(128 - zp) * sum(w)``; every product is at most
  ``2**14`` in magnitude, so int32 cannot overflow below ``K = 2**17`` inputs. Longer rows use float64, and so do
  rows of a single input: with ``K == 1`` torch 2.13's CPU ``_int_mm`` returns garbage.
* conv and long linears run float64 ``F.conv``/``matmul`` on the integers ``q_x - zp_x`` and ``q_w``. Each product is
  below ``2**15`` and every partial sum stays far below ``2**53``, so each float64 operation is exact whatever the
  summation order (BLAS blocking, FMA). PyTorch's float64 CPU convolution is direct/im2col; the transforms that are
  not exact (Winograd, FFT in NNPACK) exist for float32 only. Zero padding of ``q_x - zp_x`` is real zero, which is
  what the int8 kernels pad with (the zero point). Depthwise convs sum the same products tap by tap instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxquant.kernels.base import ConvSpec, PackedWeight
from fxquant.kernels.plain_int8 import PlainInt8Backend, requantize, weight_scale
from fxquant.kernels.registry import register_backend
from fxquant.qparams import QParams

_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# |(q - 128) * w| <= 2**14, so an int32 sum of fewer than 2**17 such products cannot overflow.
_INT32_SAFE_K = 2**17


@dataclass(frozen=True)
class IntegerWeight:
    """What the reference backend keeps of a layer: int8 weights, their float64 scales, the float bias."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    spec: ConvSpec | None = None


def integer_linear(a: torch.Tensor, zero_point: int, weight: torch.Tensor) -> torch.Tensor:
    """``(a - zero_point) @ weight.T`` for uint8 ``a`` and int8 ``weight``, exactly, as float64 integers."""
    k = a.shape[-1]
    rows = a.reshape(-1, k)
    if 1 < k < _INT32_SAFE_K:
        shifted = (rows.to(torch.int16) - 128).to(torch.int8)
        acc = torch._int_mm(shifted, weight.t()).to(torch.float64)
        acc += (128 - zero_point) * weight.sum(1, dtype=torch.int64).to(torch.float64)
    else:
        acc = (rows.to(torch.float64) - zero_point) @ weight.t().to(torch.float64)
    return acc.reshape(*a.shape[:-1], weight.shape[0])


def integer_conv(a: torch.Tensor, zero_point: int, weight: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """The convolution of ``a - zero_point`` with int8 ``weight``, exactly, as float64 integers."""
    x = a.to(torch.float64) - zero_point
    if spec.groups > 1 and weight.shape[1] == 1:
        return _depthwise_by_taps(x, weight.to(torch.float64), spec)
    return _CONVS[spec.dim](x, weight.to(torch.float64), None, spec.stride, spec.padding, spec.dilation,
                            spec.groups)


def _depthwise_by_taps(x: torch.Tensor, weight: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """Depthwise conv as one multiply-add per kernel tap: PyTorch's float64 grouped conv loops over groups and was
    measured 2-7x slower. The same exact products, summed in another order, so the result is identical."""
    x = x.repeat_interleave(weight.shape[0] // x.shape[1], dim=1)  # a channel multiplier reads its input repeatedly
    x = F.pad(x, [p for pad in reversed(spec.padding) for p in (pad, pad)])
    kernel = weight.shape[2:]
    out_size = [(x.shape[2 + i] - spec.dilation[i] * (kernel[i] - 1) - 1) // spec.stride[i] + 1
                for i in range(spec.dim)]
    acc = x.new_zeros(x.shape[0], weight.shape[0], *out_size)
    for tap in itertools.product(*(range(k) for k in kernel)):
        window = tuple(slice(t * d, t * d + s * (o - 1) + 1, s)
                       for t, d, s, o in zip(tap, spec.dilation, spec.stride, out_size, strict=True))
        tap_index: tuple[slice | int, ...] = (slice(None), 0, *tap)
        tap_weight = weight[tap_index].reshape(-1, *([1] * spec.dim))
        acc.addcmul_(x[(slice(None), slice(None), *window)], tap_weight)
    return acc


def _channels_first(t: torch.Tensor, acc: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Shape a per-output-channel vector so it broadcasts along ``channel_dim`` of ``acc``."""
    if t.dim() == 0 or channel_dim == acc.dim() - 1:
        return t
    return t.reshape(-1, *([1] * (acc.dim() - 1 - channel_dim)))


def finish(acc: torch.Tensor, w: IntegerWeight, in_qp: QParams, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    """Add the int32-quantized bias to the accumulator and requantize it to ``out_qp``."""
    channel_dim = acc.dim() - 1 if w.spec is None else 1
    acc_scale = float(in_qp.scale) * w.scale
    if w.bias is not None:
        acc = acc + _channels_first(torch.round(w.bias / acc_scale), acc, channel_dim)
    multiplier = _channels_first(acc_scale / float(out_qp.scale), acc, channel_dim)
    return requantize(acc, multiplier, out_qp, relu=relu)


@register_backend("reference")
class ReferenceBackend(PlainInt8Backend):
    """Slow, exact and dependency-free: the backend every other one is tested against (within one int8 step)."""

    int32_accumulator = False  # long rows switch to float64 (see the module doc), so no layer can overflow

    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None) -> PackedWeight:
        return PackedWeight(self.name, _integer_weight(weight, w_qp, bias, None))

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        w: IntegerWeight = packed.payload
        acc = integer_linear(a, int(in_qp.zero_point), w.weight)
        return finish(acc, w, in_qp, out_qp, relu=relu)

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        return PackedWeight(self.name, _integer_weight(weight, w_qp, bias, spec))

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        w: IntegerWeight = packed.payload
        assert w.spec is not None, "conv() got weights packed by prepack_linear()"
        acc = integer_conv(a, int(in_qp.zero_point), w.weight, w.spec)
        return finish(acc, w, in_qp, out_qp, relu=relu)


def _integer_weight(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                    spec: ConvSpec | None) -> IntegerWeight:
    float_bias = None if bias is None else bias.detach().to(torch.float64)
    scale = weight_scale(w_qp, weight).to(torch.float64)
    return IntegerWeight(weight.to(torch.int8), scale, float_bias, spec)


__all__ = ["IntegerWeight", "ReferenceBackend", "finish", "integer_conv", "integer_linear"]

"""The reference backend: integer arithmetic in plain PyTorch, defining what every other backend must compute.

Activations are plain ``torch.uint8`` tensors. Linear and conv compute the exact integer accumulator
``sum((q_x - zp_x) * q_w)``, add the bias quantized like fbgemm does (``round(bias / (s_x * s_w))``), and requantize
once: ``clamp(round(acc * s_x * s_w / s_out) + zp_out, qmin, qmax)``; a fused ReLU clamps at ``zp_out``.

Why the accumulators are exact:

* linear uses ``torch._int_mm`` (int8 x int8 -> int32; on CPU it takes any shape). The uint8 activation is shifted
  to int8 by subtracting 128 and the shift is added back as ``(128 - zp) * sum(w)``; every product is at most
  ``2**14`` in magnitude, so int32 cannot overflow below ``K = 2**17`` inputs. Longer rows use float64, and so do
  rows of a single input: with ``K == 1`` torch 2.13's CPU ``_int_mm`` returns garbage. So does every row where
  oneDNN, which runs ``_int_mm``, lacks VNNI (a CPU without it, or ``ONEDNN_MAX_CPU_ISA`` below it): it sums pairs
  of products in 16 bits and saturates (measured 79-171 output steps off). A probe of saturating values, run once,
  tells; where it fails, every linear takes float64.
* conv and long linears run float64 ``F.conv``/``matmul`` on the integers ``q_x - zp_x`` and ``q_w``. Each product is
  below ``2**15`` and every partial sum stays far below ``2**53``, so each float64 operation is exact whatever the
  summation order (BLAS blocking, FMA). PyTorch's float64 CPU convolution is direct/im2col; the transforms that are
  not exact (Winograd, FFT in NNPACK) exist for float32 only. Zero padding of ``q_x - zp_x`` is real zero, which is
  what the int8 kernels pad with (the zero point). Depthwise convs sum the same products tap by tap instead.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fxquant.kernels.base import ConvAddQParams, ConvSpec, PackedWeight
from fxquant.kernels.plain_int8 import PlainInt8Backend, centered, requantize, weight_scale
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


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether this process's ``torch._int_mm`` sums products in 32 bits: pairs of ``127 * 127`` overflow int16."""
    ones = torch.full((17, 64), 127, dtype=torch.int8)
    return bool((torch._int_mm(ones, ones.t().contiguous()) == 127 * 127 * 64).all())


def integer_linear(a: torch.Tensor, zero_point: int, weight: torch.Tensor) -> torch.Tensor:
    """``(a - zero_point) @ weight.T`` for uint8 ``a`` and int8 ``weight``, exactly, as float64 integers."""
    k = a.shape[-1]
    rows = a.reshape(-1, k)
    if 1 < k < _INT32_SAFE_K and int_mm_is_exact():
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
    """Depthwise conv as one multiply-add per kernel tap: PyTorch's float64 grouped conv loops over groups, one slow
    conv per channel. The same exact products, summed in another order, so the result is identical."""
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


def output_steps(acc: torch.Tensor, w: IntegerWeight, in_qp: QParams, out_qp: QParams) -> torch.Tensor:
    """The accumulator plus the int32-quantized bias, in units of ``out_qp``'s step (float64, not yet rounded)."""
    channel_dim = acc.dim() - 1 if w.spec is None else 1
    acc_scale = float(in_qp.scale) * w.scale
    if w.bias is not None:
        acc = acc + _channels_first(torch.round(w.bias / acc_scale), acc, channel_dim)
    return acc * _channels_first(acc_scale / float(out_qp.scale), acc, channel_dim)


def finish(acc: torch.Tensor, w: IntegerWeight, in_qp: QParams, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    """Add the int32-quantized bias to the accumulator and requantize it to ``out_qp``."""
    return requantize(output_steps(acc, w, in_qp, out_qp), 1.0, out_qp, relu=relu)


def _to_float(acc: torch.Tensor, w: IntegerWeight, in_qp: QParams, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    """``s_x * s_w * (acc + round(bias / (s_x * s_w)))`` in float64, then float32: a layer's output unrounded."""
    real = output_steps(acc, w, in_qp, out_qp) * float(out_qp.scale)
    return (real.clamp_(min=0) if relu else real).float()


@register_backend("reference")
class ReferenceBackend(PlainInt8Backend):
    """Slow, exact and dependency-free: the backend every other one is tested against (within one int8 step)."""

    int32_accumulator = False  # long rows switch to float64 (see the module doc), so no layer can overflow
    fuses_conv_add = True  # the single-rounding conv + add that fusing backends are checked against
    fuses_float_output = fuses_float_conv_output = True  # and the unrounded float Linear/Conv

    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, *,
                       in_qp: QParams | None = None) -> PackedWeight:
        return PackedWeight(self.name, _integer_weight(weight, w_qp, bias, None))

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        w: IntegerWeight = packed.payload
        acc = integer_linear(a, int(in_qp.zero_point), w.weight)
        return finish(acc, w, in_qp, out_qp, relu=relu)

    def linear_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                        relu: bool) -> torch.Tensor:
        """The exact accumulator (plus the int32-rounded bias) times its scale, not rounded to ``out_qp``."""
        w: IntegerWeight = packed.payload
        return _to_float(integer_linear(a, int(in_qp.zero_point), w.weight), w, in_qp, out_qp, relu=relu)

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        return PackedWeight(self.name, _integer_weight(weight, w_qp, bias, spec))

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        w: IntegerWeight = packed.payload
        assert w.spec is not None, "conv() got weights packed by prepack_linear()"
        acc = integer_conv(a, int(in_qp.zero_point), w.weight, w.spec)
        return finish(acc, w, in_qp, out_qp, relu=relu)

    def conv_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                      relu: bool) -> torch.Tensor:
        """``linear_to_float`` for a Conv: the exact accumulator plus bias, times its scale, unrounded."""
        w: IntegerWeight = packed.payload
        assert w.spec is not None, "conv_to_float() got weights packed by prepack_linear()"
        acc = integer_conv(a, int(in_qp.zero_point), w.weight, w.spec)
        return _to_float(acc, w, in_qp, out_qp, relu=relu)

    def conv_add(self, a: torch.Tensor, packed: PackedWeight, accum: torch.Tensor, qps: ConvAddQParams, *,
                 relu: bool) -> torch.Tensor:
        """The conv accumulator and the other addend summed in output steps and rounded once (float64: every
        term is an integer times a scale ratio, so only that final rounding is inexact)."""
        w: IntegerWeight = packed.payload
        assert w.spec is not None, "conv_add() got weights packed by prepack_linear()"
        total = output_steps(integer_conv(a, int(qps.input.zero_point), w.weight, w.spec), w, qps.input, qps.out)
        total += centered(accum, qps.accum, torch.float64) * (float(qps.accum.scale) / float(qps.out.scale))
        return requantize(total, 1.0, qps.out, relu=relu)

    def fixed_range(self, a: torch.Tensor, function: str, qa: QParams, qout: QParams) -> torch.Tensor:
        """A 256-entry table: the function of every input level in float64, rounded once to ``qout``."""
        return fixed_range_table(function, qa, qout)[a.long()]


_FIXED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardsigmoid": F.hardsigmoid}


def fixed_range_table(function: str, qa: QParams, qout: QParams) -> torch.Tensor:
    """``q_out`` for every stored input level ``0 .. qa.qmax``, indexed by the level (activations are uint8)."""
    levels = torch.arange(0, qa.qmax + 1, dtype=torch.float64)
    values = _FIXED[function]((levels - int(qa.zero_point)) * float(qa.scale))
    return requantize(values, 1.0 / float(qout.scale), qout, relu=False)


def _integer_weight(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                    spec: ConvSpec | None) -> IntegerWeight:
    float_bias = None if bias is None else bias.detach().to(torch.float64)
    scale = weight_scale(w_qp, weight).to(torch.float64)
    return IntegerWeight(weight.to(torch.int8), scale, float_bias, spec)


__all__ = ["IntegerWeight", "ReferenceBackend", "finish", "fixed_range_table", "integer_conv", "integer_linear",
           "output_steps"]

"""Element-wise int8 ops on plain ``torch.uint8`` activations, shared by the reference and oneDNN backends.

Both backends represent an activation as a plain integer tensor plus fxquant's :class:`QParams`, so quantize,
dequantize, add, relu, the average pools and the weight checks are the same code; only linear/conv differ.
``requantize`` is the one place where an accumulator is scaled, rounded (half to even, like ``torch.round`` and the
kernels' ``nearbyint``), shifted by the output zero point and clamped; a fused ReLU is a clamp at the zero point.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fxquant.errors import ConfigError
from fxquant.kernels.base import Backend
from fxquant.qparams import QParams, dequantize, quantize

_ADAPTIVE_POOLS = {3: F.adaptive_avg_pool1d, 4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}
_AVG_POOLS = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def requantize(acc: torch.Tensor, multiplier: torch.Tensor | float, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    """``clamp(round(acc * multiplier) + zero_point, qmin, qmax)`` as ``out_qp``'s integer dtype.

    ``acc`` is in units of ``1 / multiplier`` output steps (an int32 accumulator, or a float sum); the arithmetic
    runs in ``acc``'s float dtype (float64 for integer accumulators) so that only the final rounding is inexact.
    """
    scale_dtype = acc.dtype if acc.is_floating_point() else torch.float64
    zero_point = int(out_qp.zero_point)
    q = torch.round(acc.to(scale_dtype) * multiplier) + zero_point
    low = max(out_qp.qmin, zero_point) if relu else out_qp.qmin
    return q.clamp_(low, out_qp.qmax).to(out_qp.dtype)


def weight_scale(w_qp: QParams, weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight scales (0-d, or one per output channel), once the weights are checked to be what int8
    kernels take: plain int8, symmetric (zero point 0), per-tensor or per-channel along axis 0."""
    problem = ""
    if weight.dtype != torch.int8:
        problem = f"weights must be torch.int8, got {weight.dtype}"
    elif w_qp.axis not in (None, 0) or (w_qp.axis == 0 and w_qp.scale.numel() != weight.shape[0]):
        problem = f"per-channel weight qparams must have one scale per output channel (axis 0), got axis={w_qp.axis}"
    elif bool((w_qp.zero_point != 0).any()):
        problem = "int8 kernels need symmetric weights (zero point 0)"
    if problem:
        raise ConfigError(f"{problem}; use a symmetric weight observer (per-tensor or per-channel on axis 0)")
    return w_qp.scale.detach().to(torch.float32)


def centered(a: torch.Tensor, qp: QParams, dtype: torch.dtype) -> torch.Tensor:
    """``a - zero_point`` in float ``dtype``: exact, since 9-bit integers fit any float mantissa."""
    return a.to(dtype) - int(qp.zero_point)


class PlainInt8Backend(Backend):
    """Quantize/dequantize/add/relu/pools for backends whose activations are plain uint8 tensors.

    ``elementwise_dtype`` is the float type add and the pools compute in: float64 for the reference backend, where
    every intermediate value except the final division is exact, float32 where speed matters more than a rare
    one-step difference at a rounding tie.
    """

    elementwise_dtype: ClassVar[torch.dtype] = torch.float64

    def quantize(self, x: torch.Tensor, qp: QParams) -> torch.Tensor:
        return quantize(x, qp)

    def dequantize(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return dequantize(a, qp)

    def add(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams, *,
            relu: bool) -> torch.Tensor:
        # (qa - za) * sa is a 9-bit integer times a float32 scale: exact in float64, and so is the sum of two of
        # them unless the scales differ by ~2^20. The division by the output scale is the one rounding step.
        dtype = self.elementwise_dtype
        total = centered(a, qa, dtype) * float(qa.scale) + centered(b, qb, dtype) * float(qb.scale)
        return requantize(total, 1.0 / float(qout.scale), qout, relu=relu)

    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        # Real zero is the zero point, so ReLU never needs the scale. clamp reads strides, so a channels-last
        # input (oneDNN conv output) is handled as it is.
        return torch.clamp(a, min=int(qp.zero_point))

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        # torch 2.13's channels-last max-pool kernel rejects int8/uint8 inputs with more than 127 positions per
        # channel ("Expected input_depth * input_height * input_width <= ..."); oneDNN convs return channels-last.
        return super().max_pool(a.contiguous(), qp, dim, kwargs)

    def adaptive_avg_pool(self, a: torch.Tensor, qp: QParams, output_size: Any) -> torch.Tensor:
        pooled = _ADAPTIVE_POOLS[a.dim()](centered(a, qp, self.elementwise_dtype), output_size)
        return requantize(pooled, 1.0, qp, relu=False)

    def avg_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        # Pooling ``a - zero_point`` (not ``a``) makes zero padding mean real zero, as count_include_pad expects;
        # with the same qparams in and out, the result is the rounded mean of the integers.
        pooled = _AVG_POOLS[dim](centered(a, qp, self.elementwise_dtype), **kwargs)
        return requantize(pooled, 1.0, qp, relu=False)

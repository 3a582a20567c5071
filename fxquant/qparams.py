"""Affine quantization parameters and the one place where the affine formula lives.

``q = clamp(round(x / scale) + zero_point, qmin, qmax)`` and ``x ~= (q - zero_point) * scale``. Every backend, the
observers and the tests derive their numbers from these functions, so a scale is computed the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Activations are unsigned 8-bit (asymmetric); weights are signed 8-bit (symmetric). These match what the fbgemm,
# qnnpack and oneDNN int8 kernels expect.
UINT8_RANGE = (0, 255)
INT8_RANGE = (-128, 127)
# fbgemm's depthwise and non-VNNI kernels sum pairs of u8*s8 products in 16 bits: 7-bit activations avoid saturation.
REDUCED_UINT8_RANGE = (0, 127)
_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True, eq=False)
class QParams:
    """Quantization parameters of one tensor.

    ``scale`` and ``zero_point`` are 0-d tensors for per-tensor quantization, or 1-d tensors along ``axis`` for
    per-channel quantization.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    qmin: int
    qmax: int
    axis: int | None = None

    def __post_init__(self) -> None:
        # Kernels take Python numbers; converting 0-d tensors on every call would cost microseconds per layer.
        cached = None if self.axis is not None else (float(self.scale), int(self.zero_point))
        object.__setattr__(self, "_scalar", cached)

    @property
    def dtype(self) -> torch.dtype:
        """The plain integer dtype that holds the quantized values."""
        return torch.uint8 if self.qmin >= 0 else torch.int8

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    def scalar(self) -> tuple[float, int]:
        """``(scale, zero_point)`` as Python numbers; only valid for per-tensor parameters."""
        if self._scalar is None:  # type: ignore[attr-defined]
            raise ValueError("scalar() needs per-tensor qparams")
        return self._scalar  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, torch.Tensor | int | None]:
        return {
            "scale": self.scale,
            "zero_point": self.zero_point,
            "qmin": self.qmin,
            "qmax": self.qmax,
            "axis": self.axis,
        }


def affine_qparams(
    min_val: torch.Tensor, max_val: torch.Tensor, qrange: tuple[int, int] = UINT8_RANGE
) -> QParams:
    """Asymmetric qparams covering ``[min_val, max_val]`` (widened to include 0 so that 0 is exact)."""
    qmin, qmax = qrange
    lo = torch.clamp(min_val.float(), max=0.0)
    hi = torch.clamp(max_val.float(), min=0.0)
    scale = torch.clamp((hi - lo) / float(qmax - qmin), min=_EPS)
    zero_point = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax).to(torch.int64)
    return QParams(scale, zero_point, qmin, qmax, None if scale.dim() == 0 else 0)


def symmetric_qparams(
    min_val: torch.Tensor, max_val: torch.Tensor, *, axis: int | None = None,
    qrange: tuple[int, int] = INT8_RANGE,
) -> QParams:
    """Symmetric signed qparams (zero point 0) covering ``[-amax, amax]``; used for weights."""
    qmin, qmax = qrange
    amax = torch.maximum(min_val.float().abs(), max_val.float().abs())
    scale = torch.clamp(amax / ((qmax - qmin) / 2.0), min=_EPS)
    zero_point = torch.zeros_like(scale, dtype=torch.int64)
    return QParams(scale, zero_point, qmin, qmax, axis)


def _broadcast(qp: QParams, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if qp.axis is None:
        return qp.scale, qp.zero_point
    shape = [1] * x.dim()
    shape[qp.axis] = -1
    return qp.scale.reshape(shape), qp.zero_point.reshape(shape)


def quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Float tensor -> plain integer tensor (``torch.uint8`` or ``torch.int8``) with round-half-to-even."""
    scale, zero_point = _broadcast(qp, x)
    q = torch.round(x.float() / scale) + zero_point
    return torch.clamp(q, qp.qmin, qp.qmax).to(qp.dtype)


def dequantize(q: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Plain integer tensor -> float tensor."""
    scale, zero_point = _broadcast(qp, q)
    return (q.to(torch.float32) - zero_point) * scale


def fake_quantize(x: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Quantize then dequantize in float: the simulation every INT8 kernel is checked against."""
    return dequantize(quantize(x, qp), qp)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``reference``, in dB (inf when exact)."""
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))

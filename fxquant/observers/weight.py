"""Weight observers: symmetric int8, per output channel (default) or per tensor."""

from __future__ import annotations

import torch

from fxquant.observers.base import WeightObserver
from fxquant.qparams import QParams, symmetric_qparams


class PerChannelWeightObserver(WeightObserver):
    """One scale per output channel: what conv/linear kernels support at no extra cost, and far more accurate."""
    name = "per_channel"

    def qparams(self, weight: torch.Tensor, *, axis: int = 0) -> QParams:
        flat = weight.detach().transpose(0, axis).reshape(weight.shape[axis], -1)
        lo, hi = torch.aminmax(flat, dim=1)
        return symmetric_qparams(lo, hi, axis=axis)


class PerTensorWeightObserver(WeightObserver):
    """One scale for the whole weight tensor."""
    name = "per_tensor"

    def qparams(self, weight: torch.Tensor, *, axis: int = 0) -> QParams:
        lo, hi = torch.aminmax(weight.detach())
        return symmetric_qparams(lo, hi)

"""The observer contract.

An observer is an identity ``nn.Module`` that records statistics of the tensors flowing through it. Its statistics
live in buffers (plain tensors, so ``state_dict()`` saves and ``load_state_dict()`` restores them), ``merge`` combines
two observers' statistics (sharded or resumed calibration), and ``qparams`` turns statistics into quantization
parameters *at convert time*, for whatever integer range the chosen kernel needs.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from fxquant.errors import CalibrationError
from fxquant.observers.counting import dense_flat
from fxquant.qparams import UINT8_RANGE, QParams, affine_qparams


class Observer(nn.Module):
    """Base class of activation observers; subclasses implement ``_update`` and ``_merge``.

    ``min_val``/``max_val`` (the running range) are kept by every observer so that summaries, reports and the
    ``minmax`` fallback are available whatever the range method is.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "activation"
    min_val: torch.Tensor
    max_val: torch.Tensor
    num_updates: torch.Tensor
    num_elements: torch.Tensor

    def __init__(self, **options: Any) -> None:
        super().__init__()
        if options:
            raise TypeError(f"{type(self).__name__} takes no options {sorted(options)}")
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("num_updates", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("num_elements", torch.tensor(0, dtype=torch.int64))
        self.enabled = True
        self.label = ""  # the graph location, set by insert_observers; used in error messages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled and isinstance(x, torch.Tensor) and x.is_floating_point():
            self.update(x)
        return x

    def update(self, x: torch.Tensor) -> None:
        """Record the statistics of ``x``; raises ``CalibrationError`` on NaN/Inf and leaves the state untouched.

        This runs for every observer on every calibration batch, so it costs one ``aminmax`` over ``x`` plus a
        handful of scalar ops (NaN/Inf is checked on the two extremes as Python floats: ``aminmax`` propagates NaN,
        and ``torch.isfinite`` on a 0-d tensor is four dispatched ops).
        """
        if x.numel() == 0:
            return
        if torch.is_grad_enabled() or x.requires_grad:
            with torch.no_grad():
                self._record(x.detach())
        else:
            self._record(x)

    def _record(self, x: torch.Tensor) -> None:
        """``update`` without the autograd guard: range, ``_update`` hook, then the running statistics."""
        lo, hi = torch.aminmax(dense_flat(x))  # channels-last activations: reduced in memory order, no copy
        self._check_finite(lo.item(), hi.item())
        self._update(x, lo, hi)
        self._count(lo, hi, x.numel())

    def _check_finite(self, lo: float, hi: float) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise CalibrationError(
                f"observer {self.label or type(self).__name__} received NaN or Inf values; clean the data or "
                "pass skip_nonfinite=True to calibrate() to skip such batches"
            )

    def _count(self, lo: torch.Tensor | float, hi: torch.Tensor | float, elements: int) -> None:
        """Fold one batch's range into ``min_val``/``max_val`` and count it."""
        if isinstance(lo, torch.Tensor) and isinstance(hi, torch.Tensor):
            torch.minimum(self.min_val, lo, out=self.min_val)
            torch.maximum(self.max_val, hi, out=self.max_val)
        else:
            self.min_val.fill_(min(float(lo), float(self.min_val)))
            self.max_val.fill_(max(float(hi), float(self.max_val)))
        self.num_updates.add_(1)
        self.num_elements.add_(elements)

    def _update(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Hook for statistics beyond the range; called before ``min_val``/``max_val`` are updated."""

    @property
    def has_data(self) -> bool:
        return int(self.num_updates) > 0

    @torch.no_grad()
    def merge(self, other: Observer) -> None:
        """Combine ``other``'s statistics into this observer (same class and options required)."""
        if type(other) is not type(self):
            raise CalibrationError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if not other.has_data:
            return
        self._merge(other)
        self.min_val.copy_(torch.minimum(self.min_val, other.min_val))
        self.max_val.copy_(torch.maximum(self.max_val, other.max_val))
        self.num_updates += other.num_updates
        self.num_elements += other.num_elements

    def _merge(self, other: Observer) -> None:
        """Hook for merging statistics beyond the range; called before the range is merged."""

    def qparams(self, qrange: tuple[int, int] = UINT8_RANGE) -> QParams:
        """Per-tensor affine qparams for ``qrange``; raises ``CalibrationError`` if the observer saw no data."""
        if not self.has_data:
            raise CalibrationError(f"observer {self.label or type(self).__name__} saw no data; run calibrate() first")
        # One thread: range searches reduce over small tensors, and a parallel reduction's order (so its last bits)
        # depends on the thread count; qparams rebuilt from saved statistics must come out bit-identical.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            lo, hi = self.range()
        finally:
            torch.set_num_threads(threads)
        return affine_qparams(lo, hi, qrange)

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The clipping range this observer's method chooses; the running min/max unless overridden."""
        return self.min_val.clone(), self.max_val.clone()

    def extra_repr(self) -> str:
        if not self.has_data:
            return f"{self.label}, no data"
        return f"{self.label}, min={float(self.min_val):.4g}, max={float(self.max_val):.4g}"


class WeightObserver:
    """Base class of weight observers: stateless functions from a weight tensor to symmetric int8 qparams."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "weight"

    def qparams(self, weight: torch.Tensor, *, axis: int = 0) -> QParams:
        raise NotImplementedError

"""``percentile``: clip each side at a percentile of everything observed, read from the stored histogram."""

from __future__ import annotations

from typing import Any

import torch

from fxquant.errors import ConfigError
from fxquant.observers.hist_math import quantile
from fxquant.observers.histogram import HistogramObserverBase


class PercentileObserver(HistogramObserverBase):
    """Range = [(100 - p)-th percentile, p-th percentile]: drops the rarest values on each side.

    Options: ``percentile`` (default 99.99, in (50, 100]; 100 is minmax up to a bin), ``bins`` (default 2048).
    Percentiles are exact up to one bin width, since counts are interpolated linearly inside a bin.

    Example::

        obs = PercentileObserver(percentile=99.9)
        obs(torch.randn(1000))
    """
    name = "percentile"

    def __init__(self, *, percentile: float = 99.99, **options: Any) -> None:
        super().__init__(**options)
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 50 < percentile <= 100:
            raise ConfigError(f"PercentileObserver: percentile must be a number in (50, 100], got {percentile!r}")
        self.percentile = float(percentile)

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return super().range()
        upper = self.percentile / 100.0
        lo, hi = quantile(self.stored_histogram(), torch.tensor([1.0 - upper, upper], dtype=torch.float64))
        return self._observed(float(lo), float(hi))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, percentile={self.percentile:g}"

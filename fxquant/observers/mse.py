"""``mse``: the clipping range with the smallest expected squared error of quantization plus clipping."""

from __future__ import annotations

import torch

from fxquant.observers.hist_math import best_range
from fxquant.observers.histogram import HistogramObserverBase

# Candidate fractions of the observed range: 1%, 2%, ..., 100% (100% is minmax, so mse never loses to it).
_FRACTIONS = torch.arange(1, 101, dtype=torch.float64) / 100.0


class MseObserver(HistogramObserverBase):
    """Searches clipping ranges that are fractions of the observed ``[min, max]``, scored on the stored histogram.

    Three passes of 100 candidates: both ends scaled together, then the top alone, then the bottom alone — so data
    with outliers on one side only keeps its other side intact. Each candidate is scored by the expected mean
    squared error of fake quantization (rounding inside the range, clipping outside), see
    :func:`~fxquant.observers.hist_math.expected_sq_error`. Options: ``bins`` (default 2048).
    """
    name = "mse"

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return super().range()
        hist = self.stored_histogram()
        low, high = float(self.min_val), float(self.max_val)
        lo, hi = best_range(hist, _FRACTIONS * low, _FRACTIONS * high)
        _, hi = best_range(hist, torch.full_like(_FRACTIONS, lo), _FRACTIONS * high)
        lo, _ = best_range(hist, _FRACTIONS * low, torch.full_like(_FRACTIONS, hi))
        return self._observed(lo, hi)

"""``entropy``: TensorRT's KL-divergence calibration, read from the stored histogram.

For each candidate threshold ``T`` the reference distribution ``P`` is the histogram of ``|x|`` cut at ``T`` with the
clipped mass added to its last bin; ``Q`` is ``P``'s bins (without the clipped mass) merged into the available
quantization levels and spread back evenly over the bins that were non-empty. The threshold minimising
``KL(P || Q)`` is chosen. One-sided data (min >= 0, or max <= 0) uses all 255 levels on its one side and clips only
the far end; two-sided data uses a symmetric threshold, so 128 levels per side.
"""

from __future__ import annotations

import torch

from fxquant.observers.hist_math import fold_abs
from fxquant.observers.histogram import HistogramObserverBase
from fxquant.observers.registry import register_observer

_ONE_SIDED_LEVELS = 255
_TWO_SIDED_LEVELS = 128
_COARSE_CANDIDATES = 128  # thresholds scored first; the best is then refined bin by bin
_SMOOTHING = 1e-4  # Q's value where P has mass but Q has none (MXNet's smoothing), instead of an infinite KL


def kl_divergences(counts: torch.Tensor, levels: int, thresholds: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q)`` for each threshold (a number of bins of ``counts``, >= ``levels``), vectorised over thresholds."""
    n, k = counts.numel(), thresholds.numel()
    bins = torch.arange(n)[None, :]
    cut = thresholds[:, None]
    reference = torch.where(bins < cut, counts[None, :], 0.0)
    level = torch.div(bins * levels, cut, rounding_mode="floor").clamp(max=levels - 1)
    flat = (torch.arange(k)[:, None] * levels + level).reshape(-1)
    nonempty = (reference > 0).double()
    level_mass = torch.zeros(k * levels, dtype=torch.float64).index_add_(0, flat, reference.reshape(-1))
    level_bins = torch.zeros(k * levels, dtype=torch.float64).index_add_(0, flat, nonempty.reshape(-1))
    candidate = (level_mass / level_bins.clamp(min=1.0))[flat].reshape(k, n) * nonempty
    clipped = counts.sum() - reference.sum(1, keepdim=True)
    reference = reference.scatter_add(1, cut - 1, clipped)
    p = reference / reference.sum(1, keepdim=True)
    q = candidate / candidate.sum(1, keepdim=True).clamp(min=1e-300)
    q = torch.where((p > 0) & (q == 0), _SMOOTHING, q)
    return torch.where(p > 0, p * torch.log(p / q), 0.0).sum(1)


def best_threshold(counts: torch.Tensor, levels: int) -> int:
    """The number of bins of ``counts`` to keep: coarse pass over the thresholds, then every bin around the best."""
    n = counts.numel()
    if n <= levels:
        return n
    coarse = torch.linspace(levels, n, _COARSE_CANDIDATES).round().long().unique()
    best = int(coarse[torch.argmin(kl_divergences(counts, levels, coarse))])
    step = -(-(n - levels) // (_COARSE_CANDIDATES - 1))
    fine = torch.arange(max(levels, best - step), min(n, best + step) + 1)
    return int(fine[torch.argmin(kl_divergences(counts, levels, fine))])


@register_observer("entropy")
class EntropyObserver(HistogramObserverBase):
    """Threshold minimising the KL divergence between the data and its quantized version (TensorRT's method).

    Options: ``bins`` (default 2048). The threshold is a whole number of ``|x|`` bins; the returned range is
    ``[0, T]``, ``[-T, 0]`` or ``[-T, T]`` intersected with the observed range (levels past the data are wasted).
    """

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return super().range()
        low, high = float(self.min_val), float(self.max_val)
        one_sided = low >= 0 or high <= 0
        folded = fold_abs(self.stored_histogram())
        levels = _ONE_SIDED_LEVELS if one_sided else _TWO_SIDED_LEVELS
        threshold = best_threshold(folded.counts, levels) * folded.width
        return self._observed(-threshold, threshold)

"""``entropy``: TensorRT's KL-divergence calibration, following NVIDIA's pytorch-quantization implementation.

Read from the stored histogram folded to ``|x|`` (:func:`~fxquant.observers.hist_math.fold_abs`). Every candidate
threshold ``T`` (a whole number of bins, from 128 bins up to the whole histogram) is scored by ``KL(P || Q)``:

* ``P`` is the histogram cut at ``T``, the clipped mass added to its last bin;
* ``Q`` is ``P``'s bins (without the clipped mass) merged into ``levels`` quantization bins (bin ``j`` in level
  ``floor(j * levels / T)``) and spread back evenly over the bins that were non-empty.

The largest threshold among the minima is chosen. ``levels`` is 256 for one-sided data (min >= 0, or max <= 0: all
uint8 levels on one side) and 128 for two-sided data (a symmetric threshold, 128 levels per side): NVIDIA's
``1 << (num_bits - 1 + unsigned)``. Two details decide the result on real activations:

* The zero spike. As NVIDIA does, the first bin's count (``[0, width)``) is replaced by the second's before
  scoring. Post-ReLU activations put about half their values exactly at 0; left in, that one bin dominates ``P``,
  and spreading it over the other bins of its level costs so much divergence that only thresholds leaving bin 0
  alone in its level (``T`` near ``levels`` bins) look good, and the thresholds collapse (docs/calibration.md,
  "Range methods of the histogram family", has the measurement on the digits CNN). 0 is exactly representable at
  any threshold, so the spike says nothing about where to clip.
* An empty last bin. When ``T`` ends on an empty bin while mass lies beyond it, ``Q`` has nothing where ``P`` has
  the clipped mass. NVIDIA's divergence is then infinite (scipy's ``entropy``), so a threshold can never fall in
  the gap below a few isolated outliers, the case clipping exists for. That bin of ``Q`` gets MXNet's and ONNX
  Runtime's smoothing mass instead, ``_SMOOTHING`` counts: clipping ``c`` of ``N`` values then costs about
  ``c / N * log(c * S / (N * eps))`` (``S`` the kept mass), small for a few outliers, large for real mass.
  With no mass below ``T`` at all the divergence stays infinite.
"""

from __future__ import annotations

import torch

from fxquant.observers.hist_math import fold_abs
from fxquant.observers.histogram import HistogramObserverBase

_ONE_SIDED_LEVELS = 256
_TWO_SIDED_LEVELS = 128
START_BIN = 128  # the smallest candidate threshold, in bins (TensorRT's and NVIDIA's)
SMOOTHING = 1e-4  # counts given to Q's empty last bin when P has clipped mass there (MXNet's / ONNX Runtime's eps)
_CHUNK = 512  # thresholds scored per vectorised step: bounds the temporaries to ~_CHUNK * levels float64 each


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.special.xlogy(x, x)


def kl_divergences(counts: torch.Tensor, levels: int, thresholds: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q)`` for each threshold (a number of bins of ``counts``, >= 1), in O(levels) per threshold.

    ``counts`` is used as given (the zero-spike replacement is :func:`best_threshold`'s). Expanded per bin, the
    divergence is a sum of prefix sums over quantization levels: with ``c`` the counts, ``m`` and ``e`` a level's
    mass and non-empty bins, ``S`` the mass below ``T`` and ``N`` the total,
    ``N * KL = sum c log c - S log N + S log S - sum m log(m / e)``, plus the last bin's clipped mass. Every
    threshold thus costs ``levels`` operations instead of a pass over the bins, and all of them are scored.
    """
    counts = counts.double()
    zero = torch.zeros(1, dtype=torch.float64)
    mass = torch.cat([zero, counts.cumsum(0)])
    nonempty = torch.cat([zero, (counts > 0).double().cumsum(0)])
    entropy_part = torch.cat([zero, _xlogx(counts).cumsum(0)])
    cut = thresholds.long()
    edges = torch.div(torch.arange(levels + 1)[None, :] * cut[:, None] + levels - 1, levels, rounding_mode="floor")
    level_mass = mass[edges[:, 1:]] - mass[edges[:, :-1]]
    level_bins = nonempty[edges[:, 1:]] - nonempty[edges[:, :-1]]
    kept, total = mass[cut], mass[-1]
    spread = torch.special.xlogy(level_mass, level_mass / level_bins.clamp(min=1.0)).sum(1)
    scaled = entropy_part[cut] - kept * torch.log(total) + _xlogx(kept) - spread
    level = torch.div((cut - 1) * levels, cut, rounding_mode="floor")[:, None]
    last_q = level_mass.gather(1, level)[:, 0] / level_bins.gather(1, level)[:, 0].clamp(min=1.0)
    return (scaled + _clipped_mass_term(counts[cut - 1], last_q, kept, total)) / total


def _clipped_mass_term(last: torch.Tensor, last_q: torch.Tensor, kept: torch.Tensor, total: torch.Tensor
                       ) -> torch.Tensor:
    """``N * KL`` change from adding the clipped mass ``N - S`` to ``P``'s last bin (count ``last``, ``Q`` count
    ``last_q``); an empty last bin gets :data:`SMOOTHING` counts in ``Q``, which renormalises the rest of ``Q``."""
    clipped = total - kept
    n_q = total * last_q / kept.clamp(min=1e-300)  # N * q of the last bin, Q normalised by S
    grown = torch.special.xlogy(last + clipped, (last + clipped) / n_q.clamp(min=1e-300))
    term = torch.where(clipped > 0, grown - torch.special.xlogy(last, last / n_q.clamp(min=1e-300)), 0.0)
    smoothed_q = total * SMOOTHING / (kept + SMOOTHING)
    renormalised = kept * torch.log1p(SMOOTHING / kept.clamp(min=1e-300))  # every other bin: Q's total is S + eps
    smoothed = torch.special.xlogy(clipped, clipped / smoothed_q) + renormalised
    term = torch.where((clipped > 0) & (last == 0), smoothed, term)
    return torch.where(kept > 0, term, torch.inf)


def best_threshold(counts: torch.Tensor, levels: int) -> int:
    """The number of bins of ``|x|`` counts to keep: every threshold from :data:`START_BIN` bins is scored.

    Ties (and an all-infinite divergence) go to the largest threshold, as NVIDIA's ``last_argmin`` does.
    """
    n = counts.numel()
    if n <= START_BIN:
        return n
    counts = counts.double().clone()
    counts[0] = counts[1]
    thresholds = torch.arange(START_BIN, n + 1)
    divergences = torch.cat([kl_divergences(counts, levels, part) for part in thresholds.split(_CHUNK)])
    minima = torch.nonzero(divergences == divergences.min()).flatten()
    return int(thresholds[minima[-1]])


class EntropyObserver(HistogramObserverBase):
    """Threshold minimising the KL divergence between the data and its quantized version (TensorRT's method).

    Options: ``bins`` (default 2048). The threshold is a whole number of ``|x|`` bins; the returned range is
    ``[0, T]``, ``[-T, 0]`` or ``[-T, T]`` intersected with the observed range (levels past the data are wasted).
    """
    name = "entropy"

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return super().range()
        low, high = float(self.min_val), float(self.max_val)
        one_sided = low >= 0 or high <= 0
        folded = fold_abs(self.stored_histogram())
        levels = _ONE_SIDED_LEVELS if one_sided else _TWO_SIDED_LEVELS
        threshold = best_threshold(folded.counts, levels) * folded.width
        return self._observed(-threshold, threshold)

"""Pure functions over a fixed-size histogram laid on a power-of-two grid.

The grid has ``bins`` bins of width ``width`` (a power of two) starting at ``start`` (a multiple of ``width``). For a
data range ``[lo, hi]`` the grid is *canonical*: the narrowest power-of-two width whose aligned bins cover the range
(see :func:`grid_for`). Two consequences make histograms cheap to keep and to combine:

* growing the range never re-reads data: every old bin lies inside exactly one new bin, so re-binning is an exact
  ``index_add`` (:func:`rebin`), and more than half of the bins still cover the data (unless it is near-constant);
* the final grid depends only on the data's range, not on batch order or on how the data was split across shards;
  the counts too, bit for bit, on a grid starting at or above 0 (non-negative data, e.g. post-ReLU) counted on the
  ``bincount`` path; otherwise a value within float32 rounding of a bin edge may sit in the neighbouring bin
  (:mod:`fxquant.observers.counting` says why).

The range methods (L2, percentile, entropy, MSE) read the same histogram through :func:`quantile`,
:func:`fold_abs` and :func:`expected_sq_error`, all vectorised over bins and candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxquant.qparams import UINT8_RANGE, affine_qparams

# A constant tensor still gets a usable grid: its bins are at least 2**-20 of its magnitude wide, which also keeps
# ``start / width`` below 2**22 so the grid is exact in float32 (what ``torch.histc`` and ``counting`` compute in).
_FLOOR_BITS = 20
_MIN_EXPONENT = -100  # the grid of an all-zero tensor
_CHUNK = 128  # candidate ranges evaluated per batch in expected_sq_error: bounds the temporary memory


@dataclass(frozen=True)
class Histogram:
    """Counts (float64, one per bin) on the grid ``start + width * [0, 1, ..., bins]``."""

    counts: torch.Tensor
    start: float
    width: float

    @property
    def bins(self) -> int:
        return self.counts.numel()


def grid_for(lo: float, hi: float, bins: int, min_width: float = 0.0) -> tuple[float, float]:
    """``(start, width)`` of the canonical grid covering ``[lo, hi]``, with ``width >= min_width`` (a power of two).

    The result only grows when ``[lo, hi]`` grows, so a stored histogram never has to be split, only merged.
    """
    magnitude = max(abs(lo), abs(hi))
    exponent = max(math.frexp(magnitude)[1] - 1 - _FLOOR_BITS, _MIN_EXPONENT) if magnitude > 0 else _MIN_EXPONENT
    step = (hi - lo) / (bins - 1)
    if step > 0:  # 0 also when a denormal span underflows: the minimum exponent covers it
        exponent = max(exponent, math.ceil(math.log2(step)))
    if min_width > 0:
        exponent = max(exponent, math.frexp(min_width)[1] - 1)
    while True:  # at most a step or two: alignment can push the top edge just below hi
        width = math.ldexp(1.0, exponent)
        start = math.floor(lo / width) * width
        if start > lo:  # a tiny negative lo (a denormal) divided to -0.0: its bin is the one below zero
            start -= width
        if start + bins * width >= hi:
            return start, width
        exponent += 1


def rebin(hist: Histogram, start: float, width: float, bins: int) -> torch.Tensor:
    """The counts of ``hist`` on the coarser aligned grid ``(start, width, bins)``; exact, no data re-read."""
    factor = round(width / hist.width)
    if factor < 1 or factor * hist.width != width:
        raise AssertionError(f"grid width {width} is not a power-of-two multiple of {hist.width}")
    # Python ints: a tiny old width (an all-zero first batch) makes the offset too large for int64.
    base, remainder = divmod(round((hist.start - start) / hist.width), factor)
    old = torch.arange(hist.bins, device=hist.counts.device)
    if factor >= hist.bins:  # at most one new edge falls inside the old grid
        index = base + (old >= min(factor - remainder, hist.bins)).long()
    else:
        index = base + torch.div(old + remainder, factor, rounding_mode="floor")
    inside = (index >= 0) & (index < bins)
    if bool((hist.counts[~inside] != 0).any()):
        raise AssertionError("the target grid does not cover the histogram's non-empty bins")
    out = torch.zeros(bins, dtype=torch.float64, device=hist.counts.device)
    return out.index_add_(0, index[inside], hist.counts[inside].double())


def quantile(hist: Histogram, q: torch.Tensor) -> torch.Tensor:
    """Values below which a fraction ``q`` of the counts lie, interpolating linearly inside a bin.

    ``q = 0`` gives the left edge of the first non-empty bin and ``q = 1`` the right edge of the last one.
    """
    counts = hist.counts.double()
    cdf = counts.cumsum(0)
    total = cdf[-1]
    target = (q.double() * total).clamp(min=float(total) * 1e-12, max=float(total))
    index = torch.searchsorted(cdf, target).clamp(max=hist.bins - 1)
    below = cdf[index] - counts[index]
    frac = ((target - below) / counts[index].clamp(min=1e-300)).clamp(0.0, 1.0)
    return hist.start + hist.width * (index.double() + frac)


def fold_abs(hist: Histogram) -> Histogram:
    """The histogram of ``|x|`` on ``[0, n * width)``, merging bins in pairs until ``n <= hist.bins``.

    Exact because 0 is always a grid edge: bin ``[k w, (k+1) w)`` with ``k < 0`` folds onto ``[(-k-1) w, -k w)``
    (a negative value lying exactly on an edge thus lands one bin below its magnitude: immaterial for a range).
    """
    nonzero = hist.counts > 0
    k = round(hist.start / hist.width) + torch.arange(hist.bins)
    folded = torch.where(k >= 0, k, -k - 1)[nonzero]
    counts = hist.counts[nonzero].double()
    n = int(folded.max()) + 1 if folded.numel() else 1
    factor = 1 << max(0, math.ceil(math.log2(n / hist.bins))) if n > hist.bins else 1
    n = -(-n // factor)
    out = torch.zeros(n, dtype=torch.float64).index_add_(0, torch.div(folded, factor, rounding_mode="floor"), counts)
    return Histogram(out, 0.0, hist.width * factor)


def _error_antiderivative(
    x: torch.Tensor, step: torch.Tensor, zero_point: torch.Tensor, qrange: tuple[int, int]
) -> torch.Tensor:
    """Antiderivative of the squared fake-quantization error ``(t - fq(t))**2``, continuous over the real line.

    Inside the rounding region the error is periodic with period ``step`` (each full cell integrates to
    ``step**3 / 12``); below and above it values clip to the lowest / highest level.
    """
    q_lo = (qrange[0] - zero_point) * step
    q_hi = (qrange[1] - zero_point) * step
    half = step / 2
    cube = half**3
    y = x.clamp(q_lo - half, q_hi + half) / step + 0.5
    cell = torch.floor(y)
    rounded = cell / 12.0 + ((y - cell - 0.5) ** 3 + 0.125) / 3.0
    below = ((x.clamp(max=q_lo - half) - q_lo) ** 3 + cube) / 3.0
    above = ((x.clamp(min=q_hi + half) - q_hi) ** 3 - cube) / 3.0
    return rounded * step**3 + below + above


def expected_sq_error(
    hist: Histogram, lo: torch.Tensor, hi: torch.Tensor, qrange: tuple[int, int] = UINT8_RANGE
) -> torch.Tensor:
    """Mean squared fake-quantization error of the histogram's data for each candidate range ``(lo[i], hi[i])``.

    Exact for data spread uniformly inside each bin, for the grid ``affine_qparams`` will really produce (zero
    exactly representable, zero point rounded), so rounding and clipping are weighed by one formula. The error of
    bin ``i`` is ``E(edge[i+1]) - E(edge[i])``; summed by parts, that needs ``E`` once per edge and one mat-vec.
    """
    counts = hist.counts.double()
    weights = torch.nn.functional.pad(counts, (1, 0)) - torch.nn.functional.pad(counts, (0, 1))
    needed = weights != 0  # edges inside a run of equal counts cancel out: skip them (most of a sparse histogram)
    edges = (hist.start + hist.width * torch.arange(hist.bins + 1, dtype=torch.float64))[needed][None, :]
    weights = weights[needed]
    errors = []
    for chunk_lo, chunk_hi in zip(lo.split(_CHUNK), hi.split(_CHUNK), strict=True):
        qp = affine_qparams(chunk_lo.float(), chunk_hi.float(), qrange)
        step, zero_point = qp.scale.double()[:, None], qp.zero_point.double()[:, None]
        errors.append(_error_antiderivative(edges, step, zero_point, qrange) @ weights)
    return torch.cat(errors) / (hist.width * float(counts.sum()))


def best_range(hist: Histogram, lo: torch.Tensor, hi: torch.Tensor) -> tuple[float, float]:
    """The candidate ``(lo[i], hi[i])`` with the smallest :func:`expected_sq_error` (the first one on ties)."""
    best = int(torch.argmin(expected_sq_error(hist, lo, hi)))
    return float(lo[best]), float(hi[best])

"""Histogram-family observers: histogram once during calibration, choose the clipping range later.

Every observer of the family stores the same statistic — a fixed-size histogram of everything it saw — and differs
only in how ``range()`` reads it (``histogram``: L2 search, ``percentile``, ``entropy``, ``mse``). That is why
:func:`fxquant.observers.switch.switch_method` can change the method after calibration without re-running it.

Memory bound, per observer, whatever the dataset size: ``bins * 8`` bytes (float64 counts; 16 KiB with the default
2048 bins) plus two float64 scalars for the grid (``hist_start``, ``hist_width``) and the four scalars every
observer keeps (``min_val``, ``max_val``, ``num_updates``, ``num_elements``).

Cost per update: one counting pass over the batch (:mod:`fxquant.observers.counting`: a C loop, or ``torch.bincount``
on int16 bin indices on one or two threads, ``torch.histc`` beyond), on top of the ``aminmax`` every observer does;
the grid is recomputed only when a batch extends the observed range. Batches larger than twice ``sample_values``
are counted on a sample (:meth:`HistogramObserverBase._record_sampled`), so counting costs about as much per batch
whatever the activation size, while the range stays exact. When it does, the grid width doubles as often as needed
and old bins are merged exactly into the new ones (:mod:`fxquant.observers.hist_math`): no Python loop over bins, no
sort, no re-read of earlier data.

Example::

    obs = HistogramObserver(bins=1024)
    obs(torch.randn(64, 128))
    lo, hi = obs.range()
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxquant.errors import ConfigError
from fxquant.observers.base import Observer
from fxquant.observers.counting import count, count_into, dense_flat, scan
from fxquant.observers.hist_math import Histogram, best_range, grid_for, quantile, rebin

MIN_BINS = 16
SAMPLE_BLOCK = 2048  # values per sampled run: long enough for the C loop to run at full speed on each
DEFAULT_SAMPLE_VALUES = 1 << 16
# Tail masses trimmed from each side by the L2 search: the discrete path torch.ao's greedy search walks along,
# evaluated all at once. Geometric, because outliers live in tiny tails and the bulk in large ones.
_TAIL_MASSES = torch.cat([torch.zeros(1, dtype=torch.float64), torch.logspace(-6, -0.6, 15, dtype=torch.float64)])
_REFINE_POINTS = 8  # per side, between the neighbours of the best coarse candidate


class HistogramObserverBase(Observer):
    """Keeps a ``bins``-bin histogram on a power-of-two grid; subclasses only override ``range()``.

    Options:

    * ``bins`` (default 2048, at least 16): more bins resolve the range more finely, at 8 bytes each.
    * ``sample_values`` (default ``2**16``; ``None`` or 0 counts every value): a batch of more than twice this many
      values has its histogram counted on about this many of them, every ``k``-th run of 2048 contiguous values
      (``k`` the smallest prime giving at most ``sample_values`` values, plus one run), each count weighted by
      ``k``. Counting every value of large activations put calibration above its cost bound on convnets whose
      float layers do little work per activation; the sample bounds the counting per batch (docs/calibration.md,
      "The default observer"). The running
      ``min_val``/``max_val`` are always exact (every value), so the histogram's grid and the ``minmax`` range
      cover every value; only the bin counts, so the clipping search, are estimates. Smaller batches are counted
      in full, exactly as with ``None``. The sample is a function of the batch alone (no random state): the same
      data gives the same statistics, and because each batch is sampled on its own, sharded, resumed and merged
      calibration equal one run over the same batches (counts are whole multiples of ``k``, summed exactly).
    """

    # Buffers, declared for type checkers (nn.Module.__getattr__ is typed Tensor | Module).
    histogram: torch.Tensor
    hist_start: torch.Tensor
    hist_width: torch.Tensor

    def __init__(self, *, bins: int = 2048, sample_values: int | None = DEFAULT_SAMPLE_VALUES,
                 **options: Any) -> None:
        super().__init__(**options)
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < MIN_BINS:
            raise ConfigError(f"{type(self).__name__}: bins must be an integer >= {MIN_BINS}, got {bins!r}")
        if sample_values is not None and (isinstance(sample_values, bool) or not isinstance(sample_values, int)
                                          or not (sample_values == 0 or sample_values >= SAMPLE_BLOCK)):
            raise ConfigError(
                f"{type(self).__name__}: sample_values must be an integer >= {SAMPLE_BLOCK} (values counted per "
                f"large batch), or None or 0 to count every value; got {sample_values!r}. Pass it as "
                "observer_options={'sample_values': ...}"
            )
        self.bins = bins
        self.sample_values = sample_values or None
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))
        self.register_buffer("hist_start", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("hist_width", torch.tensor(0.0, dtype=torch.float64))  # 0 until the first update

    def stored_histogram(self) -> Histogram:
        """The stored counts and grid (the counts tensor is the live buffer: do not modify it)."""
        return Histogram(self.histogram, float(self.hist_start), float(self.hist_width))

    def _covering(self, lo: float, hi: float) -> tuple[float, float]:
        """``[lo, hi]`` widened to everything this observer has already seen."""
        if self.has_data:
            return min(lo, float(self.min_val)), max(hi, float(self.max_val))
        return lo, hi

    def _grow(self, lo: float, hi: float, min_width: float = 0.0) -> tuple[float, float]:
        """Move the stored counts onto the canonical grid covering ``[lo, hi]``; returns that grid."""
        current = self.stored_histogram()
        start, width = grid_for(lo, hi, self.bins, max(min_width, current.width))
        if current.width > 0 and (start, width) != (current.start, current.width):
            self.histogram.copy_(rebin(current, start, width, self.bins))
        self.hist_start.fill_(start)
        self.hist_width.fill_(width)
        return start, width

    def _record(self, x: torch.Tensor) -> None:
        """Range and counts in one read of ``x`` (:func:`~fxquant.observers.counting.scan`) on the current grid.

        The result is the general path's exactly: the batch is counted on the current grid only when that grid is
        also the one the general path would choose (the canonical grid of the observed range, unchanged unless
        the batch widens the range enough); otherwise the general path runs (``aminmax``, grow, count). float64
        data always takes it: its extremes may round when stored in the float32 ``min_val``/``max_val``.
        """
        if self.sample_values is not None and x.numel() > 2 * self.sample_values:
            self._record_sampled(x, self.sample_values)
            return
        width = float(self.hist_width)
        if width == 0 or x.dtype == torch.float64:
            super()._record(x)
            return
        data = x if x.dtype == torch.float32 else x.float()
        start = float(self.hist_start)
        lo, hi, counts = scan(data, (start, width, self.bins))
        self._check_finite(lo, hi)
        if counts is None or self._regrid_needed(lo, hi, start, width):
            start, width = self._grow(*self._covering(lo, hi))
            count_into(self.histogram, data, start, width)
        else:
            self.histogram.add_(counts)
        self._count(lo, hi, x.numel())

    def _record_sampled(self, x: torch.Tensor, budget: int) -> None:
        """Exact range over all of ``x``; counts of every ``k``-th run of :data:`SAMPLE_BLOCK` values, times ``k``.

        ``k`` is prime so that the sampled runs do not line up with a period of the layout (channels, rows): with a
        composite stride, a channel-last activation whose channel count shares a factor with ``k`` would see some
        channels far more often than others. The sampled runs are copied into one contiguous buffer (about
        ``budget`` values), counted in one call; the values after the last whole run are not sampled.
        """
        flat = dense_flat(x)
        lo, hi = torch.aminmax(flat)
        self._check_finite(lo.item(), hi.item())
        runs = flat.numel() // SAMPLE_BLOCK
        stride = sample_stride(runs, budget)
        sample = flat[:runs * SAMPLE_BLOCK].view(runs, SAMPLE_BLOCK)[::stride].reshape(-1)
        if sample.dtype not in (torch.float32, torch.float64):
            sample = sample.float()
        start, width = self._grow(*self._covering(float(lo), float(hi)))
        self.histogram.add_(count(sample, start, width, self.bins), alpha=stride)
        self._count(lo, hi, x.numel())

    def _regrid_needed(self, lo: float, hi: float, start: float, width: float) -> bool:
        """Whether a batch spanning ``[lo, hi]`` moves the canonical grid off ``(start, width)``.

        The grid is a function of the observed range only (``grid_for`` is idempotent on its own output), so a batch
        inside that range keeps it without recomputing anything.
        """
        if float(self.min_val) <= lo and hi <= float(self.max_val):
            return False
        return grid_for(*self._covering(lo, hi), self.bins, width) != (start, width)

    def _update(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        start, width = self._grow(*self._covering(float(lo), float(hi)))
        data = x if x.dtype in (torch.float32, torch.float64) else x.float()
        count_into(self.histogram, data, start, width)

    @torch.no_grad()
    def add_histogram(self, hist: Histogram, lo: float, hi: float) -> None:
        """Add counts recorded on another grid (a shard, or another histogram observer) whose data spans ``[lo, hi]``.

        Only the histogram is updated; ``merge`` and ``switch_method`` also carry over the running min/max and counts.
        """
        start, width = self._grow(*self._covering(lo, hi), min_width=hist.width)
        self.histogram += rebin(hist, start, width, self.bins)

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, HistogramObserverBase)  # Observer.merge checked the type
        self.add_histogram(other.stored_histogram(), float(other.min_val), float(other.max_val))

    def _observed(self, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` clamped to the observed range, as 0-d tensors: a range past the data only wastes levels."""
        low, high = float(self.min_val), float(self.max_val)
        lo, hi = min(max(lo, low), high), max(min(hi, high), low)
        return torch.tensor(lo, dtype=torch.float32), torch.tensor(max(lo, hi), dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bins={self.bins}, sample_values={self.sample_values}"


def sample_stride(runs: int, budget: int, run_values: int = SAMPLE_BLOCK) -> int:
    """The smallest prime ``k`` such that every ``k``-th of ``runs`` runs of ``run_values`` values is at most
    ``budget`` values plus one run."""
    stride = max(2, math.ceil(runs * run_values / budget))
    while any(stride % d == 0 for d in range(2, math.isqrt(stride) + 1)):
        stride += 1
    return stride


class HistogramObserver(HistogramObserverBase):
    """Range minimising the L2 (squared) quantization error over the histogram, like torch.ao's HistogramObserver.

    torch.ao walks a greedy path that trims tail mass from one side at a time, computing the error of each step in
    Python. Here every pair (lower tail mass, upper tail mass) from a geometric grid of 16 levels is scored in one
    vectorised pass, then a finer grid around the best pair, with
    :func:`~fxquant.observers.hist_math.expected_sq_error` for the grid that will really be used (zero exact).
    The untrimmed pair is the exact observed ``[min, max]``, so the choice is never worse than ``minmax`` under the
    histogram's error model. Options: ``bins`` (default 2048).
    """
    name = "histogram"

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return super().range()
        hist = self.stored_histogram()
        lows, highs = quantile(hist, _TAIL_MASSES), quantile(hist, 1.0 - _TAIL_MASSES)
        lows[0], highs[0] = float(self.min_val), float(self.max_val)
        lo, hi = best_range(hist, *_pairs(lows, highs))
        # Second pass: a finer grid between the neighbours of the best coarse pair, keeping the best pair itself.
        fine_lows = torch.cat([torch.tensor([lo], dtype=torch.float64), _around(lows, lo)])
        fine_highs = torch.cat([torch.tensor([hi], dtype=torch.float64), _around(highs, hi)])
        return self._observed(*best_range(hist, *_pairs(fine_lows, fine_highs)))


def _pairs(lows: torch.Tensor, highs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``(low, high)`` combination, as two flat tensors."""
    grid_lo, grid_hi = torch.meshgrid(lows, highs, indexing="ij")
    return grid_lo.reshape(-1), grid_hi.reshape(-1)


def _around(values: torch.Tensor, chosen: float) -> torch.Tensor:
    """Evenly spaced points between the neighbours of ``chosen`` in ``values``."""
    index = int(torch.argmin((values - chosen).abs()))
    first, last = values[max(index - 1, 0)], values[min(index + 1, values.numel() - 1)]
    return torch.linspace(float(first), float(last), _REFINE_POINTS, dtype=torch.float64)

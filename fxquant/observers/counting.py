"""The histogram observers' hot loop: add the per-bin counts of a batch to a stored histogram.

This runs once per observer per calibration batch over every activation value, so it is written for speed on the
CPU threads calibration usually gets (one to four). The fast path is a C loop (``fxquant/native/csrc/histogram.c``,
built at install time when a C compiler is there): range and counts in one read of the batch, where the torch path
below takes several passes (per-value costs: docs/calibration.md, "What an update costs").

The torch path (no compiler, float64 data): per value, one fused scale-and-shift into a float scratch buffer (three
ops on a grid that starts below zero, see below), one conversion to int16 bin indices and one ``torch.bincount``.
The buffers are reused across calls (one set per thread): fresh batch-sized temporaries cost more in page faults
than the arithmetic, and allocating them per chunk costs a dispatch each. Chunks of ``_COUNT_CHUNK`` values keep the
scratch in L2 and bound it to ~384 KiB.

Both paths give a value the bin ``floor(x / width) - start / width``, exactly: ``width`` is a power of two, so the
scaling is exact, and ``start / width`` is an integer ``k``. So a value's bin never depends on where the grid
starts, and sharded, batched, resumed and merged counts (:func:`~fxquant.observers.hist_math.rebin` merges whole
bins) equal counting all the data at once on the final grid, bit for bit
(``tests/observers/test_histogram_exact_merge.py``, with ``torch.equal``). The C loop floors, then subtracts ``k``
as integers. The torch path does the same where the grid starts below zero; from a start at or above zero, one
fused ``x / width - k`` is already exact (``y = x / width >= k``, so ``y - k`` is a multiple of ``y``'s ulp no
larger than ``y``: representable) and saves two passes. On a grid with a negative start the fused op is not
exact (a value within ``bins * 2**-24`` bins of an edge can move one bin), so there the torch path floors first.

The ``torch.histc`` path (more than four threads; without the C loop more than two, or more than 32,767 bins; or not
on the CPU) has its own rounding.
"""

from __future__ import annotations

import math

import torch

from fxquant import native
from fxquant.native.scratch import scratch

_INT16_BINS = 32767
_NATIVE_BINS = 1 << 22
_COUNT_CHUNK = 1 << 16  # values binned per step: scratch of 4 + 2 bytes per value stays in L2
Grid = tuple[float, float, int]  # (start, width, bins)


def dense_flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a 1-D tensor without a copy when its memory is dense (contiguous, channels-last...).

    Counting does not care about element order, and ``reshape(-1)`` of a channels-last activation would copy it.
    """
    if x.is_contiguous():
        return x.view(-1)
    expected = 1
    for dim in sorted(range(x.dim()), key=x.stride):
        if x.size(dim) != 1 and x.stride(dim) != expected:
            return x.reshape(-1)
        expected *= x.size(dim)
    return x.as_strided((x.numel(),), (1,))


def _use_native(x: torch.Tensor, bins: int) -> bool:
    """The C loop: float32 on the CPU, one to four threads (``torch.histc`` splits the work beyond).

    Its edge tests compare float32 values with float32 edges, which equal the float64 ones:
    :func:`~fxquant.observers.hist_math.grid_for` keeps ``start / width`` below 2**22, so with up to 2**22 bins both
    edges are integers below 2**24 times a power of two.
    """
    return (native.available("histogram") and x.dtype == torch.float32 and x.device.type == "cpu"
            and bins <= _NATIVE_BINS)


def _native_scan(flat: torch.Tensor, grid: Grid) -> tuple[float, float, torch.Tensor | None]:
    """:func:`scan` by the C loop; the counts are a per-thread scratch buffer, valid until the next call."""
    start, width, bins = grid
    counts = scratch("histogram counts", bins, torch.float64)
    lo, hi, on_grid = native.scan_into(counts, flat, start, start + bins * width)
    return lo, hi, counts if on_grid else None


def _use_bincount(x: torch.Tensor, bins: int) -> bool:
    """Up to two threads, bincount on int16 indices beats the parallel but slower-per-value ``torch.histc``
    (docs/calibration.md, "What an update costs")."""
    return torch.get_num_threads() <= 2 and bins <= _INT16_BINS and x.device.type == "cpu"


class _Binner:
    """Bins chunks of values onto one grid, accumulating int64 counts (the top edge in an extra last slot)."""

    def __init__(self, size: int, grid: Grid, dtype: torch.dtype) -> None:
        start, width, bins = grid
        self.values = scratch("histogram values", size, dtype)
        self.index = scratch("histogram index", size, torch.int16)
        self.offset, self.scale = -start / width, 1.0 / width  # exact: start is a multiple of width, a power of 2
        self.bins = bins
        self.counts = torch.zeros(bins + 1, dtype=torch.int64)

    def add(self, part: torch.Tensor) -> None:
        values, index = self.values, self.index
        if part.numel() != values.numel():
            values, index = values[:part.numel()], index[:part.numel()]
        if self.offset <= 0:  # grid start >= 0: the one fused op is exact (see the module docstring)
            index.copy_(torch.add(self.offset, part, alpha=self.scale, out=values))  # truncation == floor: >= 0
        else:  # floor before the shift, or a value within rounding of an edge could move bins between grids
            index.copy_(torch.mul(part, self.scale, out=values).floor_().add_(self.offset))
        self.counts += torch.bincount(index, minlength=self.bins + 1)

    def folded(self) -> torch.Tensor:
        """The ``bins`` counts, values on the top edge in the last bin (as ``torch.histc`` does)."""
        self.counts[self.bins - 1] += self.counts[self.bins]
        return self.counts[:self.bins]


def count_into(histogram: torch.Tensor, x: torch.Tensor, start: float, width: float) -> None:
    """Add the per-bin counts of ``x`` (all of whose values lie on the grid) to the float64 ``histogram``, in place.

    The grid is ``start + width * [0, 1, ..., bins]`` with ``bins = histogram.numel()``; the top edge itself belongs
    to the last bin, as in ``torch.histc``.
    """
    bins = histogram.numel()
    if _use_native(x, bins):
        counts = _native_scan(dense_flat(x), (start, width, bins))[2]
        if counts is None:
            raise ValueError("count_into: values off the grid (the caller must grow the grid first)")
        histogram += counts
        return
    if not _use_bincount(x, bins):
        histogram += torch.histc(x, bins, min=start, max=start + bins * width).to(histogram.dtype)
        return
    flat = dense_flat(x)
    binner = _Binner(min(flat.numel(), _COUNT_CHUNK), (start, width, bins), x.dtype)
    for begin in range(0, flat.numel(), _COUNT_CHUNK):
        binner.add(flat[begin:begin + _COUNT_CHUNK])
    histogram += binner.folded()


def scan(x: torch.Tensor, grid: Grid) -> tuple[float, float, torch.Tensor | None]:
    """``x``'s min and max, and its per-bin counts when every value lies on the grid: one read of ``x``.

    Each chunk's ``aminmax`` pulls it into cache for the binning right after, so a batch larger than the cache is
    read from memory once instead of twice. The counts are None when some value lies off the grid, or is NaN/Inf
    (then the min or max is not finite): the caller moves to a wider grid and calls :func:`count_into`. The C
    loop's counts are a per-thread scratch buffer: add them before the next call.
    """
    start, width, bins = grid
    flat = dense_flat(x)
    if _use_native(x, bins):
        return _native_scan(flat, grid)
    total = flat.numel()
    if not _use_bincount(x, bins):
        lo, hi = (float(v) for v in torch.aminmax(flat))
        if not (math.isfinite(lo) and math.isfinite(hi) and start <= lo and hi <= start + bins * width):
            return lo, hi, None
        return lo, hi, torch.histc(flat, bins, min=start, max=start + bins * width).long()
    binner = _Binner(min(total, _COUNT_CHUNK), grid, x.dtype)
    lo, hi, top = math.inf, -math.inf, start + bins * width
    for begin in range(0, total, _COUNT_CHUNK):
        part = flat[begin:begin + _COUNT_CHUNK]
        low, high = (float(v) for v in torch.aminmax(part))
        if not (math.isfinite(low) and math.isfinite(high)):
            return low, high, None
        lo, hi = min(lo, low), max(hi, high)
        if low < start or high > top:
            if begin + _COUNT_CHUNK < total:  # the caller needs the whole batch's range for the new grid
                low, high = (float(v) for v in torch.aminmax(flat[begin + _COUNT_CHUNK:]))
                if not (math.isfinite(low) and math.isfinite(high)):
                    return low, high, None
            return min(lo, low), max(hi, high), None
        binner.add(part)
    return lo, hi, binner.folded()


def count(x: torch.Tensor, start: float, width: float, bins: int) -> torch.Tensor:
    """Per-bin counts (float64) of ``x``, whose values all lie on the grid ``(start, width, bins)``."""
    histogram = torch.zeros(bins, dtype=torch.float64, device=x.device)
    count_into(histogram, x, start, width)
    return histogram

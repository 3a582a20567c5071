"""The typed wrapper of ``scan_f32`` (``fxquant/native/csrc/histogram.c``): the histogram observers' counting.

The contract (bins, edges, exactness) is :mod:`fxquant.observers.counting`'s; this module only moves tensors in and
out of the C loop.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxquant.native import loader
from fxquant.native.loader import extension


class HistogramGrid(NamedTuple):
    """C ``HistogramGrid``: ``bins`` bins of equal power-of-two width from ``start`` to ``top``, both exact in
    float32 (else the loop raises ValueError)."""

    start: float
    top: float
    bins: int


class Scan(NamedTuple):
    """The min and max of every value (NaN if one is NaN), and whether all lie on the grid (then counted)."""

    lo: float
    hi: float
    on_grid: bool


def scan_into(counts: torch.Tensor, x: torch.Tensor, start: float, top: float) -> Scan:
    """Min, max and per-bin counts of the dense float32 ``x`` in one read, on the grid of ``counts.numel()`` bins
    from ``start`` to ``top`` (values equal to ``top`` in the last bin, as ``torch.histc``).

    ``counts`` (contiguous float64) is overwritten with the counts where every value lies on the grid, and left
    alone otherwise; the min and max cover the whole of ``x`` either way, because the caller grows the grid to them.
    The caller checks that :data:`~fxquant.native.loader.loops` is there.
    """
    assert loader.loops is not None and x.is_contiguous() and x.dtype == torch.float32
    assert counts.is_contiguous() and counts.dtype == torch.float64
    grid = HistogramGrid(start, top, counts.numel())
    return Scan(*extension.scan_f32(x.data_ptr(), x.numel(), grid, counts.data_ptr()))

"""The C counting loop (``fxquant/native/csrc/histogram.c``) against exact float64 bins and the pure-torch path, edge
cases included.

The torch path is the one a machine without a C compiler runs: the histogram observers' results must not depend on
which one counted.
"""

from __future__ import annotations

import math

import pytest
import torch

from fxquant import native
from fxquant.observers import counting
from fxquant.observers.hist_math import grid_for


def test_the_c_loop_is_built() -> None:
    assert native.loops is not None, (
        "fxquant.native._native was not built: reinstall with a C compiler (pip install -e .) for faster histograms")


def both_paths(x: torch.Tensor, grid: counting.Grid, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[tuple[float, float, torch.Tensor | None], tuple[float, float, torch.Tensor | None]]:
    assert native.loops is not None and counting._use_native(x, grid[2])
    lo, hi, counts = counting.scan(x, grid)
    fast = (lo, hi, None if counts is None else counts.clone())  # the C loop's counts are a scratch buffer
    with monkeypatch.context() as patch:
        patch.setattr(native, "loops", None)
        reference = counting.scan(x, grid)
    return fast, reference


def assert_same(fast: tuple[float, float, torch.Tensor | None], reference: tuple[float, float, torch.Tensor | None]
                ) -> None:
    (lo, hi, counts), (ref_lo, ref_hi, ref_counts) = fast, reference
    if ref_counts is None:  # off the grid or not finite: the torch path may stop early, the C loop reads everything
        assert counts is None
        assert math.isnan(lo) or lo <= ref_lo
        return
    assert (lo, hi) == (ref_lo, ref_hi)
    assert counts is not None and torch.equal(counts, ref_counts.double()), f"{(counts - ref_counts).abs().sum()} off"


def exact_counts(x: torch.Tensor, start: float, width: float, bins: int) -> torch.Tensor:
    """``floor((x - start) / width)`` in float64 (exact: ``width`` is a power of two), the top edge in the last bin."""
    index = (torch.floor(x.double() / width) - round(start / width)).long().clamp(max=bins - 1)
    return torch.bincount(index, minlength=bins).double()


@pytest.mark.parametrize("size", [1, 3, 15, 16, 17, 2047, 2048, 2049, 70_001, 3 * counting._COUNT_CHUNK + 5])
@pytest.mark.parametrize("bins", [16, 2048, 40_000])
def test_counts_are_the_exact_bins(size: int, bins: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C loop bins exactly; so does the torch path up to 32,767 bins (beyond, it is ``torch.histc``)."""
    x = torch.randn(size, generator=torch.Generator().manual_seed(size + bins)) * 3
    x[0] = 0.0
    start, width = grid_for(float(x.min()), float(x.max()), bins)
    native_result, reference = both_paths(x, (start, width, bins), monkeypatch)
    expected = exact_counts(x, start, width, bins)
    assert native_result[2] is not None and torch.equal(native_result[2], expected)
    if bins <= counting._INT16_BINS:
        assert_same(native_result, reference)


def test_values_on_both_edges_fall_in_the_first_and_last_bin(monkeypatch: pytest.MonkeyPatch) -> None:
    start, width, bins = -4.0, 2.0**-6, 512
    top = start + bins * width
    x = torch.tensor([start, top, top, start + width, top - width / 2, 0.0] * 5)
    fast, reference = both_paths(x, (start, width, bins), monkeypatch)
    assert_same(fast, reference)
    counts = fast[2]
    assert counts is not None and int(counts[0]) == 5 and int(counts[-1]) == 15 and int(counts[1]) == 5


@pytest.mark.parametrize("position", [0, 7, 2048 + 3, -1])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e3])
def test_off_grid_or_nonfinite_values_give_no_counts_and_the_whole_range(
        position: int, bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(3 * 2048 + 11) * 4
    x[position] = bad
    x[-2] = 5.5  # after the bad value: the range must still cover it
    grid = (0.0, 2.0**-8, 2048)
    fast, reference = both_paths(x, grid, monkeypatch)
    assert_same(fast, reference)
    lo, hi, counts = fast
    assert counts is None
    if math.isnan(bad):
        assert math.isnan(lo) and math.isnan(hi)
    else:
        assert (lo, hi) == (float(x.min()), float(x.max()))


def test_grids_not_exact_in_float32_are_refused() -> None:
    assert native.loops is not None
    out = torch.zeros(16, dtype=torch.float64)
    x = torch.rand(100)
    with pytest.raises(ValueError, match="exact in float32"):
        native.scan_into(out, x, 0.1, 1.7)


def test_count_into_adds_to_the_histogram_and_refuses_values_off_the_grid() -> None:
    x = torch.rand(10_000) * 2
    start, width = grid_for(0.0, 2.0, 256)
    histogram = torch.ones(256, dtype=torch.float64)
    counting.count_into(histogram, x, start, width)
    expected = torch.histc(x, 256, start, start + 256 * width).double() + 1
    assert torch.equal(histogram, expected)
    with pytest.raises(ValueError, match="off the grid"):
        counting.count_into(histogram, x + 10 * start + 100, start, width)

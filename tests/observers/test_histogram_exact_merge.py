"""Sharded, batched histograms against counting all the data at once on the final grid.

The reference here bins in float64 with ``floor(x / width) - start / width`` (exact for float32 data: ``width`` is
a power of two and ``start`` a multiple of it), independently of :mod:`fxquant.observers.counting`. The observers'
counts equal it bit for bit, however the data is batched, sharded and merged, for non-negative (post-ReLU) and
signed data, with and without the C loop; a third of the values sit exactly on, or next to, bin edges.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxquant.observers import HistogramObserver
from fxquant.observers.hist_math import grid_for

pytestmark = pytest.mark.usefixtures("native_loops")

BINS = (16, 2048)


def reference_counts(data: torch.Tensor, bins: int) -> tuple[torch.Tensor, float, float]:
    """Counts of all of ``data`` at once on its canonical grid, binned exactly in float64."""
    start, width = grid_for(float(data.min()), float(data.max()), bins)
    index = torch.floor(data.double() / width) - round(start / width)
    counts = torch.bincount(index.long(), minlength=bins).double()
    return counts, start, width


def planted_data(seed: int, size: int, exponent: int, relu: bool) -> torch.Tensor:
    """Normal data scaled by ``2**exponent``, a third rounded onto fine power-of-two edges, zeros included."""
    rng = np.random.default_rng(seed)
    data = rng.normal(size=size) * 2.0**exponent
    snap = rng.random(size) < 1 / 3
    step = 2.0 ** (exponent - rng.integers(3, 12))
    data[snap] = np.round(data[snap] / step) * step  # values exactly on (or next to) bin edges of many grids
    data = np.maximum(data, 0.0) if relu else data
    return torch.from_numpy(data.astype(np.float32))


def calibrate_sharded(data: torch.Tensor, seed: int, shards: int, bins: int) -> HistogramObserver:
    """Random batch boundaries, batches dealt to ``shards`` observers at random, merged in a random order."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, data.numel()), size=min(12, data.numel() - 1), replace=False))
    observers = [HistogramObserver(bins=bins) for _ in range(shards)]
    for batch in np.split(data.numpy(), cuts):
        observers[int(rng.integers(shards))](torch.from_numpy(batch))
    order = [o for o in rng.permutation(shards) if observers[o].has_data]
    merged = observers[order[0]]
    for other in order[1:]:
        merged.merge(observers[other])
    return merged


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    size=st.integers(2, 3000),
    exponent=st.integers(-20, 20),
    shards=st.integers(1, 4),
    bins=st.sampled_from(BINS),
    relu=st.booleans(),
)
def test_sharded_batched_counts_equal_counting_everything_at_once(seed: int, size: int, exponent: int, shards: int,
                                                                 bins: int, relu: bool) -> None:
    data = planted_data(seed, size, exponent, relu=relu)
    merged = calibrate_sharded(data, seed, shards, bins)
    expected, start, width = reference_counts(data, bins)
    assert (float(merged.hist_start), float(merged.hist_width)) == (start, width)
    assert torch.equal(merged.histogram, expected), f"{float((merged.histogram - expected).abs().sum())} differ"

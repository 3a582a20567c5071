"""The histogram family's one-read fast path (counting.scan) leaves exactly the state of the general path.

The general path is ``Observer._record``: ``aminmax`` over the whole batch, grow the grid, count the batch on it. The
fast path counts chunk by chunk on the current grid and falls back when the grid must change; these tests drive
batches larger than one chunk whose range grows in a late chunk, in several dtypes and memory layouts, and compare
every buffer with ``torch.equal``; the final grid and counts are also checked against ``torch.histc`` of all the data.
"""

from __future__ import annotations

import pytest
import torch

from fxquant.errors import CalibrationError
from fxquant.native import scratch
from fxquant.observers import HistogramObserver, HistogramObserverBase, Observer, counting
from fxquant.observers.hist_math import grid_for

pytestmark = pytest.mark.usefixtures("native_loops")

CHUNK = counting._COUNT_CHUNK


class GeneralPath(HistogramObserver):
    """The reference: every batch through ``aminmax`` + grow + count, never the fast path."""

    def _record(self, x: torch.Tensor) -> None:
        Observer._record(self, x)


def growing_batches(seed: int, layout: str = "contiguous") -> list[torch.Tensor]:
    """Batches of 2.5 chunks; later batches widen the range, some only inside their last chunk."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(6):
        batch = torch.randn(5, CHUNK // 2, generator=generator) * (1 + i % 3)
        if i in (2, 4):
            batch[-1, -1] = 40.0 * i + 0.3  # grows the grid from the last chunk
        if i == 3:
            batch[-1, 0] = -float(batch.abs().max()) * 1.01  # widens the range, maybe inside the current grid
        batch = torch.relu(batch) if seed % 2 and i == 0 else batch
        batches.append(_layout(batch, layout))
    return batches


def _layout(batch: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return batch.reshape(5, 4, 64, CHUNK // 512).contiguous(memory_format=torch.channels_last)
    if layout == "transposed":
        return batch.t()
    return batch


def run(cls: type[HistogramObserverBase], batches: list[torch.Tensor]) -> HistogramObserverBase:
    obs = cls(sample_values=None)  # every value counted: these batches are above the sampling threshold
    for batch in batches:
        obs(batch)
    return obs


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (key, mine), (_, theirs) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), f"{key} differs: {float((mine.double() - theirs.double()).abs().sum())}"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
def test_fast_path_state_equals_the_general_path(seed: int, layout: str) -> None:
    batches = growing_batches(seed, layout)
    fast, general = run(HistogramObserver, batches), run(GeneralPath, batches)
    assert_same_state(fast, general)
    data = torch.cat([b.reshape(-1) for b in batches])
    start, width = grid_for(float(data.min()), float(data.max()), fast.bins)
    assert (float(fast.hist_start), float(fast.hist_width)) == (start, width)
    # Independent of both paths: histc of all the data on the final grid. Re-binning earlier batches' counts is
    # exact bin-wise, but a value within float32 rounding of a bin edge can fall on the other side of it on a grid
    # with another offset (as before this fast path existed), so allow a few such values in neighbouring bins.
    expected = torch.histc(data, fast.bins, start, start + fast.bins * width).double()
    moved = float((fast.histogram - expected).abs().sum()) / 2
    assert float(fast.histogram.sum()) == data.numel() and moved <= 1e-5 * data.numel(), f"{moved} values moved"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_match_the_general_path(dtype: torch.dtype) -> None:
    batches = [b.to(dtype) for b in growing_batches(3)]
    assert_same_state(run(HistogramObserver, batches), run(GeneralPath, batches))


def test_many_threads_take_histc_and_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.histc`` beyond four threads: the same grid and range, counts within float32 edge rounding."""
    batches = growing_batches(4)
    single = run(HistogramObserver, batches)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    many = run(HistogramObserver, batches)
    for key in ("hist_start", "hist_width", "min_val", "max_val", "num_elements"):
        assert torch.equal(getattr(many, key), getattr(single, key)), key
    moved = float((many.histogram - single.histogram).abs().sum()) / 2
    assert moved <= 1e-4 * float(single.num_elements), f"{moved} values in another bin"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_value_in_a_late_chunk_raises_and_leaves_the_state(bad: float) -> None:
    obs = run(HistogramObserver, growing_batches(5)[:2])
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    batch = torch.randn(3 * CHUNK)
    batch[-5] = bad
    with pytest.raises(CalibrationError, match="NaN or Inf"):
        obs(batch)
    for key, value in obs.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_dense_flat_reads_channels_last_memory_without_copying() -> None:
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    flat = counting.dense_flat(x)
    assert flat.data_ptr() == x.data_ptr() and flat.numel() == x.numel()
    assert torch.equal(flat.sort().values, x.reshape(-1).sort().values)
    sliced = torch.randn(4, 6)[:, :3]  # not dense: must fall back to a copy with the same values
    assert torch.equal(counting.dense_flat(sliced), sliced.reshape(-1))


def test_scratch_made_under_inference_mode_serves_later_plain_calls() -> None:
    """Regression: the reused buffers were inference tensors when first made under calibrate()'s inference mode."""
    scratch._local.__dict__.clear()
    x = torch.randn(3 * CHUNK)
    with torch.inference_mode():
        HistogramObserver(sample_values=None)(x)
    obs = HistogramObserver(sample_values=None)
    obs(x)
    obs(x * 0.5)
    assert float(obs.histogram.sum()) == 2 * x.numel()

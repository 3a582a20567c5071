"""Each histogram range method against an independent reference computed here from the raw data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxquant.observers import (
    EntropyObserver,
    HistogramObserver,
    HistogramObserverBase,
    Observer,
    get_activation_observer,
)
from fxquant.observers.counting import count
from fxquant.observers.entropy import SMOOTHING, best_threshold, kl_divergences
from fxquant.observers.hist_math import Histogram, expected_sq_error, fold_abs, grid_for, quantile, rebin
from fxquant.qparams import affine_qparams, fake_quantize

pytestmark = pytest.mark.usefixtures("native_loops")

PROPERTY = settings(max_examples=25, deadline=None)




def sample(kind: str, n: int = 20_000, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    data = {
        "normal": rng.normal(size=n),
        "relu": np.maximum(rng.normal(size=n), 0.0),
        "laplace": rng.laplace(size=n) * 3.0 + 1.0,
        "uniform": rng.uniform(0.5, 4.0, size=n),
        "skewed": rng.exponential(size=n) - 0.3,
    }[kind]
    return torch.from_numpy(data.astype(np.float32))


def with_outliers(data: torch.Tensor, count: int = 4, *, one_sided: bool = False, seed: int = 1) -> torch.Tensor:
    """``data`` with ``count`` values replaced by 100x its largest magnitude (alternating signs unless one-sided)."""
    out = data.clone()
    index = torch.from_numpy(np.random.default_rng(seed).choice(data.numel(), count, replace=False))
    signs = torch.ones(count) if one_sided else torch.tensor([1.0, -1.0] * count)[:count]
    out[index] = float(data.abs().max()) * 100.0 * signs
    return out


def observe(name: str, data: torch.Tensor, **options: object) -> Observer:
    obs = get_activation_observer(name)(**options)
    for batch in data.split(5000):
        obs(batch)
    return obs


def observe_histogram(name: str, data: torch.Tensor, **options: object) -> HistogramObserverBase:
    obs = observe(name, data, **options)
    assert isinstance(obs, HistogramObserverBase)
    return obs


def fake_quant_mse(data: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> float:
    """The brute-force reference: mean squared error of fake-quantizing the raw data with range ``[lo, hi]``."""
    return float((fake_quantize(data, affine_qparams(lo, hi)) - data).double().pow(2).mean())


@pytest.mark.parametrize("kind", ["normal", "relu", "laplace", "uniform", "skewed"])
@pytest.mark.parametrize("percentile", [90.0, 99.0, 99.9, 99.99])
def test_percentile_matches_numpy_within_a_bin(kind: str, percentile: float) -> None:
    data = sample(kind)
    obs = observe_histogram("percentile", data, percentile=percentile, bins=1024)
    lo, hi = obs.range()
    values = np.sort(data.numpy().astype(np.float64))
    for got, q in ((float(lo), 100.0 - percentile), (float(hi), percentile)):
        rank = q / 100.0 * (values.size - 1)  # numpy's rank; ours may sit one order statistic away
        near = values[max(int(rank) - 1, 0) : int(rank) + 3]
        tolerance = float(obs.hist_width) + float(near[-1] - near[0])
        expected = float(np.percentile(values, q))
        assert abs(got - expected) <= tolerance, f"p{q}: {got:.6g} vs numpy {expected:.6g}, tol {tolerance:.3g}"


@pytest.mark.parametrize("name", ["histogram", "mse"])
@pytest.mark.parametrize("kind", ["normal", "relu", "laplace", "uniform", "skewed"])
@pytest.mark.parametrize("outliers", [0, 4])
def test_l2_methods_are_not_worse_than_minmax_on_raw_data(name: str, kind: str, outliers: int) -> None:
    data = with_outliers(sample(kind), outliers) if outliers else sample(kind)
    chosen = fake_quant_mse(data, *observe(name, data).range())
    minmax = fake_quant_mse(data, *observe("minmax", data).range())
    assert chosen <= minmax * 1.01 + 1e-12, f"{name}: MSE {chosen:.4g} vs minmax {minmax:.4g}"


@pytest.mark.parametrize("name", ["entropy", "percentile", "mse"])
@pytest.mark.parametrize("kind", ["normal", "relu", "laplace"])
def test_planted_outliers_hurt_the_bulk_less_than_with_minmax(name: str, kind: str) -> None:
    bulk = sample(kind, n=50_000)
    data = torch.cat([bulk, with_outliers(bulk[:3], count=3, one_sided=kind == "relu")])
    chosen = fake_quant_mse(bulk, *observe(name, data).range())
    minmax = fake_quant_mse(bulk, *observe("minmax", data).range())
    assert chosen < minmax, f"{name}: bulk MSE {chosen:.4g} is not below minmax's {minmax:.4g}"


@pytest.mark.parametrize("kind", ["normal", "relu"])
def test_entropy_clips_below_planted_outliers(kind: str) -> None:
    data = with_outliers(sample(kind), count=4, one_sided=kind == "relu")
    lo, hi = observe("entropy", data).range()
    assert float(hi) < 0.5 * float(data.max()), f"entropy kept hi={float(hi):.4g}, outlier max {float(data.max()):.4g}"
    if kind == "relu":
        assert float(lo) == 0.0  # one-sided: only the top is clipped
    else:
        assert float(lo) == -float(hi), f"two-sided data should get a symmetric range, got ({lo}, {hi})"


def test_entropy_on_one_sided_data_keeps_the_minimum() -> None:
    data = with_outliers(sample("uniform"), count=2, one_sided=True)
    lo, _ = observe("entropy", data).range()
    assert float(lo) == float(data.min())


def naive_kl(counts: np.ndarray, levels: int, threshold: int) -> float:
    """One step of NVIDIA pytorch-quantization's ``_compute_amax_entropy``, written as plain loops from its description.

    ``P``: the first ``threshold`` bins, the clipped mass added to the last; ``Q``: those bins merged into ``levels``
    quantization bins (bin ``j`` in level ``floor(j * levels / threshold)``), each level's mass spread evenly over its
    non-empty bins; ``KL(P || Q)``. Where ``P`` has mass and ``Q`` none (only the last bin can be so), ``Q`` gets
    ``SMOOTHING`` counts (MXNet's eps) instead of NVIDIA's infinite divergence; no mass below ``threshold``: inf.
    """
    level_mass: dict[int, float] = {}
    level_bins: dict[int, int] = {}
    for j in range(threshold):
        if counts[j] > 0:
            level = j * levels // threshold
            level_mass[level] = level_mass.get(level, 0.0) + float(counts[j])
            level_bins[level] = level_bins.get(level, 0) + 1
    if not level_mass:
        return math.inf
    p = [float(c) for c in counts[:threshold]]
    p[-1] += float(counts[threshold:].sum())
    q = [level_mass[j * levels // threshold] / level_bins[j * levels // threshold] if counts[j] > 0 else 0.0
         for j in range(threshold)]
    if p[-1] > 0 and q[-1] == 0:
        q[-1] = SMOOTHING
    p_total, q_total = sum(p), sum(q)
    return sum(pi / p_total * math.log((pi / p_total) / (qi / q_total)) for pi, qi in zip(p, q, strict=True) if pi > 0)


def nvidia_threshold(counts: np.ndarray, levels: int, start_bin: int = 128) -> int:
    """NVIDIA's search: first bin's count replaced by the second's, every threshold from 128 bins, last argmin."""
    bins = counts.astype(np.float64).copy()
    bins[0] = bins[1]
    divergences = [naive_kl(bins, levels, t) for t in range(start_bin, bins.size + 1)]
    best = min(divergences)
    return start_bin + max(i for i, d in enumerate(divergences) if d == best)


def magnitude_histograms() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    t3 = np.histogram(np.abs(rng.standard_t(3, size=20_000)), bins=600)[0].astype(np.float64)
    holes = t3.copy()
    holes[rng.choice(600, 50, replace=False)] = 0.0  # empty bins inside the range exercise the expansion rule
    relu = np.histogram(np.maximum(rng.normal(size=30_000), 0.0), bins=400)[0].astype(np.float64)  # zero spike
    sparse = np.histogram(np.abs(rng.laplace(size=300)), bins=500)[0].astype(np.float64)  # a tail of lone values
    far = np.concatenate([np.zeros(200), relu[:200]])  # no mass below 200 bins: infinite divergence there
    return {"t3": t3, "holes": holes, "relu": relu, "sparse": sparse, "far": far}


@pytest.mark.parametrize("levels", [128, 256])
@pytest.mark.parametrize("name", ["t3", "holes", "relu", "sparse", "far"])
def test_kl_divergences_match_a_naive_loop(levels: int, name: str) -> None:
    counts = magnitude_histograms()[name]
    thresholds = torch.tensor([1, 2, levels - 1, levels, levels + 1, 301, 333, 397, 400])
    got = kl_divergences(torch.from_numpy(counts), levels, thresholds)
    for value, t in zip(got.tolist(), thresholds.tolist(), strict=True):
        reference = naive_kl(counts, levels, t)
        assert value == pytest.approx(reference, rel=1e-7, abs=1e-12), f"threshold {t}: {value} vs {reference}"


@pytest.mark.parametrize("levels", [128, 256])
@pytest.mark.parametrize("name", ["t3", "holes", "relu", "sparse", "far"])
def test_entropy_threshold_matches_nvidia_search(levels: int, name: str) -> None:
    counts = magnitude_histograms()[name]
    assert best_threshold(torch.from_numpy(counts), levels) == nvidia_threshold(counts, levels)


def test_entropy_ignores_the_zero_spike_of_relu_data() -> None:
    """Half the values at exactly 0 (post-ReLU) must not pull the threshold down: 0 is exact at any threshold."""
    data = torch.relu(sample("normal", n=100_000))
    _, with_zeros = observe("entropy", data).range()
    _, without = observe("entropy", data[data > 0]).range()
    assert float(with_zeros) == float(without)
    assert float(with_zeros) > 0.5 * float(data.max()), f"threshold {float(with_zeros):.4g} of max {float(data.max())}"


@pytest.mark.parametrize("kind", ["normal", "relu", "uniform"])
def test_expected_error_matches_brute_force_fake_quantization(kind: str) -> None:
    data = with_outliers(sample(kind, n=100_000), count=2)
    hist = observe_histogram("histogram", data).stored_histogram()
    lo = torch.tensor([float(data.min()), -1.0, -3.0, 0.0], dtype=torch.float64)
    hi = torch.tensor([float(data.max()), 1.0, 2.5, 0.5], dtype=torch.float64)
    model = expected_sq_error(hist, lo, hi)
    for value, a, b in zip(model.tolist(), lo, hi, strict=True):
        brute = fake_quant_mse(data, a.float(), b.float())
        assert value == pytest.approx(brute, rel=0.25), f"range ({a:.3g}, {b:.3g}): model {value:.4g} vs {brute:.4g}"


@PROPERTY
@given(lo=st.floats(-1e6, 1e6), span=st.floats(0.0, 1e6), grow=st.floats(0.0, 1e6), bins=st.sampled_from([16, 2048]))
def test_grid_covers_the_range_and_only_coarsens_as_it_grows(lo: float, span: float, grow: float, bins: int) -> None:
    start, width = grid_for(lo, lo + span, bins)
    assert start <= lo and start + bins * width >= lo + span, f"grid ({start}, {width}) misses [{lo}, {lo + span}]"
    assert math.log2(width).is_integer() and (start / width).is_integer()
    start2, width2 = grid_for(lo - grow, lo + span, bins)
    assert width2 >= width and start2 <= start, f"grid shrank: ({start}, {width}) -> ({start2}, {width2})"


@pytest.mark.parametrize("kind", ["normal", "relu", "laplace", "uniform", "skewed"])
@pytest.mark.parametrize("bins", [16, 2048])
def test_counting_bins_exactly_and_histc_within_edge_rounding(kind: str, bins: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One or two threads (the C loop, or bincount without it): the exact bins ``floor((x - start) / width)``.
    More threads count with ``torch.histc``, whose float32 arithmetic can put a value within rounding of an edge
    in the neighbouring bin: few values, one bin each."""
    data = with_outliers(sample(kind), count=3) * 0.37
    start, width = grid_for(float(data.min()), float(data.max()), bins)
    index = (torch.floor(data.double() / width) - round(start / width)).long().clamp(max=bins - 1)
    expected = torch.bincount(index, minlength=bins).double()
    for threads in (1, 8):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        got = count(data, start, width, bins)
        if threads == 1:
            assert torch.equal(got, expected), f"{float((got - expected).abs().sum())} counts differ"
        else:
            assert float(got.sum()) == data.numel()
            crossed = (got - expected).cumsum(0).abs()  # net values moved across each edge
            assert float(crossed.max()) <= 3 and float((got - expected).abs().sum()) <= 1e-3 * data.numel()


def test_rebin_merges_whole_bins_exactly() -> None:
    data = sample("laplace")
    start, width = grid_for(float(data.min()), float(data.max()), 512)
    fine = Histogram(torch.histc(data, 512, start, start + 512 * width).double(), start, width)
    wide_start, wide_width = grid_for(-1000.0, float(data.max()), 512)
    coarse = rebin(fine, wide_start, wide_width, 512)
    direct = torch.histc(data, 512, wide_start, wide_start + 512 * wide_width).double()
    assert torch.equal(coarse, direct), f"{float((coarse - direct).abs().sum())} counts in the wrong bin"


def test_fold_abs_is_the_histogram_of_the_magnitudes() -> None:
    data = sample("skewed")
    hist = observe_histogram("histogram", data, bins=256).stored_histogram()
    folded = fold_abs(hist)
    top = folded.width * folded.bins
    direct = torch.histc(data.abs(), folded.bins, 0.0, top).double()
    assert torch.equal(folded.counts, direct), f"{float((folded.counts - direct).abs().sum())} counts differ"


def test_quantile_of_an_explicit_histogram() -> None:
    hist = Histogram(torch.tensor([0.0, 2.0, 0.0, 2.0], dtype=torch.float64), start=-2.0, width=1.0)
    values = quantile(hist, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64))
    assert values.tolist() == pytest.approx([-1.0, -0.5, 0.0, 1.5, 2.0])


@pytest.mark.parametrize("name", ["histogram", "percentile", "entropy", "mse"])
def test_range_stays_inside_the_observed_range(name: str) -> None:
    data = sample("skewed") * 7.0
    lo, hi = observe(name, data).range()
    assert float(data.min()) <= float(lo) <= float(hi) <= float(data.max()), (float(lo), float(hi))


def test_entropy_of_unobserved_observer_falls_back_to_the_empty_range() -> None:
    lo, hi = EntropyObserver().range()
    assert float(lo) == math.inf and float(hi) == -math.inf


def test_grid_for_a_denormal_span_regression() -> None:
    """Shrunk by hypothesis: a span of one denormal underflowed to a zero step and log2(0) raised."""
    start, width = grid_for(-5e-324, 0.0, 16)
    assert start <= -5e-324 and start + 16 * width >= 0.0


def test_a_denormal_negative_value_stays_on_the_grid() -> None:
    """Regression (found by hypothesis): ``-5e-324 / width`` underflows to -0.0 for bins wider than 1, so the grid
    started at 0, above the value (the observer then counted it in bin 0 of a grid that did not cover it)."""
    start, width = grid_for(-5e-324, 16.0, 16)
    assert start <= -5e-324 and start + 16 * width >= 16.0
    obs = HistogramObserver(bins=16)
    obs(torch.tensor([-5e-324, 16.0], dtype=torch.float64))  # the smallest float64 denormal
    assert float(obs.hist_start) <= -5e-324 and float(obs.histogram.sum()) == 2

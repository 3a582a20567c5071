"""Contract tests every built-in activation observer passes (property tests over generated calibration data)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxquant.errors import CalibrationError, ConfigError
from fxquant.observers import HistogramObserverBase, Observer, activation_observer_names, get_activation_observer
from fxquant.qparams import fake_quantize

pytestmark = pytest.mark.usefixtures("native_loops")

ALL = activation_observer_names()
ORDER_FREE = ("minmax", "histogram", "percentile", "entropy", "mse")  # moving_average depends on order by design
PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])




@st.composite
def calibration_data(draw: st.DrawFn) -> np.ndarray:
    """Float32 data with varied shape, scale and offset, sometimes ReLU'd, constant, or with planted outliers."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 4000))
    kind = draw(st.sampled_from(["normal", "relu", "uniform", "laplace", "constant"]))
    scale = draw(st.floats(1e-3, 1e3))
    data = {
        "normal": rng.normal(size=n),
        "relu": np.maximum(rng.normal(size=n), 0.0),
        "uniform": rng.uniform(-1.0, 3.0, size=n),
        "laplace": rng.laplace(size=n),
        "constant": np.full(n, draw(st.floats(-2.0, 2.0))),
    }[kind] * scale + draw(st.floats(-1.0, 1.0)) * scale * (kind != "relu")
    outliers = draw(st.integers(0, min(3, n)))
    data[rng.choice(n, outliers, replace=False)] *= 100.0
    return data.astype(np.float32)


def observe(name: str, batches: list[np.ndarray], **options: object) -> Observer:
    obs = get_activation_observer(name)(**options)
    for batch in batches:
        obs(torch.from_numpy(np.ascontiguousarray(batch)))
    return obs


def assert_same_statistics(a: Observer, b: Observer) -> None:
    """The histogram family's counts are exact whatever the batching (``floor((x - start) / width)`` on a canonical
    grid, merged whole bins at a time): the same grid, the same counts bit for bit, so the same range."""
    assert isinstance(a, HistogramObserverBase) and isinstance(b, HistogramObserverBase)
    assert (float(a.hist_start), float(a.hist_width)) == (float(b.hist_start), float(b.hist_width))
    assert torch.equal(a.histogram, b.histogram), f"{float((a.histogram - b.histogram).abs().sum())} counts differ"
    assert [float(v) for v in a.range()] == [float(v) for v in b.range()]


@pytest.mark.parametrize("name", ALL)
@PROPERTY
@given(data=calibration_data())
def test_zero_is_exactly_representable(name: str, data: np.ndarray) -> None:
    qp = observe(name, [data]).qparams()
    error = float(fake_quantize(torch.zeros(3), qp).abs().max())
    assert error == 0.0, f"0 fake-quantizes to {error:.3g} with scale {float(qp.scale):.3g}, zp {int(qp.zero_point)}"


@PROPERTY
@given(data=calibration_data(), batches=st.integers(1, 5))
def test_minmax_qparams_cover_the_observed_range(data: np.ndarray, batches: int) -> None:
    obs = observe("minmax", np.array_split(data, batches))
    assert float(obs.min_val) == data.min() and float(obs.max_val) == data.max()
    qp = obs.qparams()
    x = torch.from_numpy(data)
    worst = float((fake_quantize(x, qp) - x).abs().max())
    bound = float(qp.scale) * (0.5 + 1e-4)
    assert worst <= bound, f"max error {worst:.4g} > half a step {bound:.4g}: some observed value is clipped"


@pytest.mark.parametrize("name", ORDER_FREE)
@PROPERTY
@given(data=calibration_data(), batches=st.integers(1, 6), seed=st.integers(0, 1000))
def test_batch_order_does_not_matter(name: str, data: np.ndarray, batches: int, seed: int) -> None:
    shuffled = np.random.default_rng(seed).permutation(data)
    a = observe(name, np.array_split(data, batches))
    b = observe(name, list(reversed(np.array_split(shuffled, batches + 1))))
    assert float(a.min_val) == float(b.min_val) and float(a.max_val) == float(b.max_val)
    if isinstance(a, HistogramObserverBase):
        assert_same_statistics(a, b)


@pytest.mark.parametrize("name", ALL)
@PROPERTY
@given(data=calibration_data(), shards=st.integers(2, 4))
def test_split_and_merge_equals_one_observer(name: str, data: np.ndarray, shards: int) -> None:
    parts = np.array_split(data, shards)
    single = observe(name, parts)
    merged = observe(name, parts[:1])
    for part in parts[1:]:
        merged.merge(observe(name, [part]))
    assert int(merged.num_elements) == data.size and int(merged.num_updates) == int(single.num_updates)
    assert float(merged.min_val) == float(single.min_val) and float(merged.max_val) == float(single.max_val)
    if name == "minmax":
        assert [float(v) for v in merged.range()] == [float(v) for v in single.range()]
    elif name != "moving_average":  # an EMA is not associative: its merge rule is tested on its own
        assert_same_statistics(single, merged)


@pytest.mark.parametrize("name", ALL)
def test_merge_into_an_empty_observer_copies_the_statistics(name: str) -> None:
    full = observe(name, [np.linspace(-1.0, 4.0, 999, dtype=np.float32)])
    empty = get_activation_observer(name)()
    empty.merge(full)
    assert [float(v) for v in empty.range()] == [float(v) for v in full.range()]


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip(name: str) -> None:
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=500).astype(np.float32) * s for s in (1.0, 3.0, 0.5)]
    obs = observe(name, batches)
    restored = get_activation_observer(name)()
    restored.load_state_dict(obs.state_dict())
    assert [float(v) for v in restored.range()] == [float(v) for v in obs.range()]
    more = torch.from_numpy(rng.normal(size=500).astype(np.float32) * 10)
    obs(more)
    restored(more)
    for key, value in obs.state_dict().items():
        assert torch.equal(value, restored.state_dict()[key]), key


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_raises_and_leaves_the_state_unchanged(name: str, bad: float) -> None:
    obs = observe(name, [np.linspace(-2.0, 5.0, 300, dtype=np.float32)])
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    poisoned = torch.linspace(-50.0, 50.0, 100)
    poisoned[7] = bad
    with pytest.raises(CalibrationError, match="NaN or Inf"):
        obs(poisoned)
    for key, value in obs.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("name", ALL)
def test_unknown_option_raises_type_error(name: str) -> None:
    with pytest.raises(TypeError, match="no_such_option"):
        get_activation_observer(name)(no_such_option=1)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("percentile", {"percentile": 30.0}),
        ("percentile", {"percentile": 100.5}),
        ("histogram", {"bins": 4}),
        ("entropy", {"bins": 2048.0}),
        ("moving_average", {"averaging_constant": 0.0}),
        ("moving_average", {"averaging_constant": 1.5}),
    ],
)
def test_invalid_option_values_raise_config_error(name: str, options: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(options))):
        get_activation_observer(name)(**options)


@pytest.mark.parametrize("name", [n for n in ALL if issubclass(get_activation_observer(n), HistogramObserverBase)])
def test_histogram_memory_is_bounded_by_bins(name: str) -> None:
    obs = get_activation_observer(name)(bins=256)
    expected = 256 * 8 + 2 * 8 + 2 * 4 + 2 * 8  # counts, grid, min/max (float32), num_updates/num_elements (int64)
    for scale in (1e-3, 1.0, 1e3, 1e6):  # the range grows by nine orders of magnitude
        obs(torch.randn(20_000) * scale)
        size = sum(t.numel() * t.element_size() for t in obs.state_dict().values())
        assert size == expected, f"state is {size} bytes, expected {expected}"
    assert float(obs.histogram.sum()) == 80_000

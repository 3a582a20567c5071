"""The histogram family's ``sample_values`` option: large batches are counted on a sample, the range stays exact.

Batches of at most ``2 * sample_values`` values must leave exactly the state of ``sample_values=None``; larger ones
keep the exact min/max, count about ``sample_values`` values weighted to the batch size, the same way every time,
and choose a clipping range close to the exact histogram's (tolerances measured on the dense activations below,
set a little above the worst of four seeds).
"""

from __future__ import annotations

import pytest
import torch

from fxquant import QuantConfig
from fxquant.errors import ConfigError
from fxquant.observers import HistogramObserverBase
from fxquant.observers.histogram import DEFAULT_SAMPLE_VALUES, SAMPLE_BLOCK, sample_stride
from fxquant.observers.registry import get_activation_observer
from fxquant.qparams import QParams

pytestmark = pytest.mark.usefixtures("native_loops")

FAMILY = ["histogram", "percentile", "entropy", "mse"]
RANGE_TOLERANCE = 0.07  # |sampled - exact| range end, as a fraction of the exact range's span (measured <= 0.055)
ERROR_TOLERANCE = 1.15  # sampled range's squared quantization error over the exact one's, on all data (<= 1.11)


def observer(name: str, **options: object) -> HistogramObserverBase:
    obs = get_activation_observer(name)(**options)
    assert isinstance(obs, HistogramObserverBase)
    return obs


def activations(seed: int) -> dict[str, torch.Tensor]:
    """Dense activations above the sampling threshold: conv-like, GELU after a Linear, channels-last."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.1, 4, 96).view(1, 96, 1, 1)
    return {
        "randn": torch.randn(8, 64, 32, 32, generator=g),
        "gelu": torch.nn.functional.gelu(torch.randn(8, 197, 384, generator=g) * 2),
        "channels_last": (torch.randn(8, 96, 28, 28, generator=g) * spread).contiguous(
            memory_format=torch.channels_last),
    }


def quant_error(x: torch.Tensor, q: QParams) -> float:
    scale, zero = float(q.scale), int(q.zero_point)
    return float(((torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale - x).square().mean())


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("numel", [1000, 2 * DEFAULT_SAMPLE_VALUES - 1, 2 * DEFAULT_SAMPLE_VALUES])
def test_batches_up_to_the_threshold_are_counted_exactly(name: str, numel: int) -> None:
    sampled, exact = observer(name), observer(name, sample_values=None)
    generator = torch.Generator().manual_seed(numel)
    for scale in (1.0, 3.0, 0.5):
        batch = torch.randn(numel, generator=generator) * scale
        sampled(batch)
        exact(batch)
    for (key, mine), (_, theirs) in zip(sampled.state_dict().items(), exact.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), key
    assert float(sampled.histogram.sum()) == 3 * numel


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", FAMILY)
def test_large_batches_keep_the_exact_range_and_a_close_clipping_range(name: str, seed: int) -> None:
    for kind, x in activations(seed).items():
        batches = [x * (1 + 0.1 * i) for i in range(3)]
        sampled, exact = observer(name), observer(name, sample_values=None)
        for batch in batches:
            sampled(batch)
            exact(batch)
        assert torch.equal(sampled.min_val, exact.min_val) and torch.equal(sampled.max_val, exact.max_val), kind
        assert (sampled.hist_start, sampled.hist_width) == (exact.hist_start, exact.hist_width), kind
        (lo_s, hi_s), (lo_e, hi_e) = sampled.range(), exact.range()
        span = float(hi_e - lo_e)
        assert abs(float(lo_s - lo_e)) <= RANGE_TOLERANCE * span, kind
        assert abs(float(hi_s - hi_e)) <= RANGE_TOLERANCE * span, kind
        error_sampled = sum(quant_error(b, sampled.qparams()) for b in batches)
        error_exact = sum(quant_error(b, exact.qparams()) for b in batches)
        assert error_sampled <= ERROR_TOLERANCE * error_exact, kind


@pytest.mark.parametrize("numel", [2 * DEFAULT_SAMPLE_VALUES + 1, 1 << 20, 3 * (1 << 20) + 777])
def test_sample_is_about_sample_values_weighted_to_the_batch(numel: int) -> None:
    obs = observer("histogram")
    obs(torch.randn(numel))
    runs = numel // SAMPLE_BLOCK
    stride = sample_stride(runs, DEFAULT_SAMPLE_VALUES)
    counted = -(-runs // stride) * SAMPLE_BLOCK
    assert counted <= DEFAULT_SAMPLE_VALUES + SAMPLE_BLOCK
    assert counted >= DEFAULT_SAMPLE_VALUES // 3
    assert float(obs.histogram.sum()) == counted * stride  # whole counts, times the stride
    assert abs(float(obs.histogram.sum()) - numel) <= stride * SAMPLE_BLOCK
    assert int(obs.num_elements) == numel


def test_sample_stride_is_prime_and_bounds_the_sample() -> None:
    for runs in (65, 100, 512, 1536, 10_000):
        stride = sample_stride(runs, DEFAULT_SAMPLE_VALUES)
        assert stride >= 2 and all(stride % d for d in range(2, stride))
        assert -(-runs // stride) * SAMPLE_BLOCK <= DEFAULT_SAMPLE_VALUES + SAMPLE_BLOCK


def test_sampling_is_deterministic_and_per_batch() -> None:
    x = torch.randn(4, 1 << 18, generator=torch.Generator().manual_seed(3))
    one, two = observer("histogram"), observer("histogram")
    one(x)
    one(x * 2)
    two(x.clone())
    two(x * 2)
    for (key, mine), (_, theirs) in zip(one.state_dict().items(), two.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), key
    first, second = observer("histogram"), observer("histogram")  # two shards, merged: same as one run
    first(x)
    second(x * 2)
    first.merge(second)
    for (key, mine), (_, theirs) in zip(one.state_dict().items(), first.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), key


@pytest.mark.parametrize("bad", [-1, 100, 2047, 1.5, "all", True])
def test_invalid_sample_values_raise_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="sample_values"):
        observer("percentile", sample_values=bad)


@pytest.mark.parametrize("off", [None, 0])
def test_none_or_zero_counts_every_value(off: int | None) -> None:
    obs = observer("histogram", sample_values=off)
    obs(torch.randn(1 << 20))
    assert obs.sample_values is None
    assert float(obs.histogram.sum()) == 1 << 20


def test_option_flows_through_quant_config() -> None:
    config = QuantConfig(observer_options={"sample_values": None},
                         overrides={"head": {"observer_options": {"sample_values": 4096}}})
    assert config.activation == "histogram"
    assert observer(config.activation, **config.settings_for("body").observer_options).sample_values is None
    assert observer(config.activation, **config.settings_for("head").observer_options).sample_values == 4096

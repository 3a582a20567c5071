"""The observer registry, ``switch_method`` and the moving-average observer's own rules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fxquant.errors import ConfigError
from fxquant.observers import (
    HistogramObserverBase,
    MinMaxObserver,
    MovingAverageObserver,
    Observer,
    activation_observer_names,
    get_activation_observer,
    register_observer,
    registry,
    switch_method,
)

BUILTIN = ("entropy", "histogram", "minmax", "moving_average", "mse", "percentile")


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registrations made by a test vanish with it."""
    activation_observer_names()  # make sure the built-ins are in the table being copied
    monkeypatch.setattr(registry, "_ACTIVATION", dict(registry._ACTIVATION))
    yield


def calibrated(name: str, **options: object) -> Observer:
    obs = get_activation_observer(name)(**options)
    obs.label = "layer1.conv"
    generator = torch.Generator().manual_seed(0)
    for scale in (1.0, 4.0, 0.5):
        obs(torch.randn(3000, generator=generator) * scale)
    return obs


def test_builtin_observers_are_registered() -> None:
    assert set(BUILTIN) <= set(activation_observer_names())


def test_duplicate_name_raises(scratch_registry: None) -> None:
    with pytest.raises(ConfigError, match="already registered"):

        @register_observer("percentile")
        class Again(MinMaxObserver):
            pass


def test_unknown_name_raises_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="Known: ") as info:
        get_activation_observer("percentil")
    message = str(info.value)
    assert "Did you mean 'percentile'" in message
    assert all(name in message for name in BUILTIN), message


def test_user_registered_observer_works_by_name(scratch_registry: None) -> None:
    @register_observer("absmax_test")
    class AbsMaxObserver(HistogramObserverBase):
        """Symmetric range from the stored histogram's statistics: shows a third-party histogram method."""

        def range(self) -> tuple[torch.Tensor, torch.Tensor]:
            amax = torch.maximum(self.min_val.abs(), self.max_val.abs())
            return -amax, amax

    obs = calibrated("absmax_test", bins=64)
    assert isinstance(obs, AbsMaxObserver) and obs.name == "absmax_test"
    lo, hi = obs.range()
    assert float(hi) == -float(lo) == max(-float(obs.min_val), float(obs.max_val))
    # Being histogram-family, it can switch to and from the built-in methods.
    assert isinstance(switch_method(obs, "percentile"), get_activation_observer("percentile"))


@pytest.mark.parametrize("source", ["histogram", "percentile", "entropy", "mse"])
@pytest.mark.parametrize("target", ["histogram", "percentile", "entropy", "mse"])
def test_switch_between_histogram_methods_keeps_the_statistics(source: str, target: str) -> None:
    obs = calibrated(source, bins=512)
    new = switch_method(obs, target)
    assert type(new) is get_activation_observer(target) and new.label == "layer1.conv"
    for key, value in obs.state_dict().items():
        assert torch.equal(new.state_dict()[key], value), key
    direct = calibrated(target, bins=512)
    assert [float(v) for v in new.range()] == [float(v) for v in direct.range()]


def test_switch_passes_options_and_fewer_bins_equal_calibrating_with_fewer_bins() -> None:
    new = switch_method(calibrated("histogram", bins=2048), "percentile", percentile=99.0, bins=256)
    direct = calibrated("percentile", percentile=99.0, bins=256)
    assert new.percentile == 99.0 and new.bins == 256
    for key, value in direct.state_dict().items():
        assert torch.equal(new.state_dict()[key], value), key


@pytest.mark.parametrize("source", BUILTIN)
def test_any_observer_switches_to_minmax(source: str) -> None:
    obs = calibrated(source)
    new = switch_method(obs, "minmax")
    assert type(new) is MinMaxObserver and new.label == obs.label
    assert (float(new.min_val), float(new.max_val)) == (float(obs.min_val), float(obs.max_val))
    assert int(new.num_updates) == 3 and int(new.num_elements) == 9000
    assert new.qparams().scalar() == calibrated("minmax").qparams().scalar()


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("minmax", "histogram"),
        ("minmax", "moving_average"),
        ("moving_average", "percentile"),
        ("mse", "moving_average"),
    ],
)
def test_impossible_switch_explains_what_is_possible(source: str, target: str) -> None:
    with pytest.raises(ConfigError, match="Possible switches") as info:
        switch_method(calibrated(source), target)
    assert "'minmax'" in str(info.value) and "percentile" in str(info.value) and "layer1.conv" in str(info.value)


def test_switch_to_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="Known: "):
        switch_method(calibrated("histogram"), "nope")


def test_switch_of_an_empty_observer_gives_an_empty_observer() -> None:
    new = switch_method(get_activation_observer("histogram")(), "entropy")
    assert not new.has_data and float(new.histogram.sum()) == 0.0


def test_moving_average_follows_the_ema_formula() -> None:
    obs = MovingAverageObserver(averaging_constant=0.25)
    ema_lo = ema_hi = None
    for lo, hi in [(-1.0, 2.0), (-3.0, 1.0), (0.5, 6.0), (-2.0, 2.0)]:
        obs(torch.tensor([lo, (lo + hi) / 2, hi]))
        ema_lo = lo if ema_lo is None else ema_lo + 0.25 * (lo - ema_lo)
        ema_hi = hi if ema_hi is None else ema_hi + 0.25 * (hi - ema_hi)
    got = [float(v) for v in obs.range()]
    assert got == pytest.approx([ema_lo, ema_hi], rel=1e-6), got
    assert (float(obs.min_val), float(obs.max_val)) == (-3.0, 6.0)  # the running range is still exact


def test_moving_average_merge_weights_by_number_of_batches() -> None:
    a, b = MovingAverageObserver(averaging_constant=1.0), MovingAverageObserver(averaging_constant=1.0)
    for _ in range(3):
        a(torch.tensor([-1.0, 1.0]))
    b(torch.tensor([-5.0, 9.0]))
    a.merge(b)
    got = [float(v) for v in a.range()]
    assert got == pytest.approx([(3 * -1.0 + -5.0) / 4, (3 * 1.0 + 9.0) / 4]), got
    assert int(a.num_updates) == 4


def test_moving_average_default_option_and_repr() -> None:
    obs = MovingAverageObserver()
    assert obs.averaging_constant == 0.01
    obs(torch.ones(4))
    assert "averaging_constant=0.01" in repr(obs)

"""Change an observer's range method after calibration, keeping the statistics it collected."""

from __future__ import annotations

from typing import Any

import torch

from fxquant.errors import ConfigError
from fxquant.observers.base import Observer
from fxquant.observers.histogram import HistogramObserverBase
from fxquant.observers.minmax import MinMaxObserver
from fxquant.observers.registry import activation_observer_names, get_activation_observer

_RUNNING_STATS = ("min_val", "max_val", "num_updates", "num_elements")


def _histogram_names() -> list[str]:
    return [n for n in activation_observer_names() if issubclass(get_activation_observer(n), HistogramObserverBase)]


def switch_method(observer: Observer, name: str, **options: Any) -> Observer:
    """A new observer of the class registered as ``name``, carrying over ``observer``'s statistics and ``label``.

    Possible switches: any observer -> ``minmax`` (every observer keeps the running min/max), and between
    histogram-family observers (they all store the same histogram; ``bins`` and ``sample_values`` default to the
    source's, and fewer bins merge the counts exactly). Anything else would need statistics that were never
    collected: raises ``ConfigError``.

    Example::

        observer = HistogramObserver()
        observer(torch.randn(10_000))  # calibration
        clipped = switch_method(observer, "percentile", percentile=99.9)
    """
    target = get_activation_observer(name)
    if issubclass(target, HistogramObserverBase) and isinstance(observer, HistogramObserverBase):
        options.setdefault("bins", observer.bins)
        options.setdefault("sample_values", observer.sample_values)
    elif not issubclass(target, MinMaxObserver):
        source = f"{observer.label or 'observer'} ({type(observer).__name__})"
        raise ConfigError(
            f"cannot switch {source} to {name!r}: {target.__name__} needs statistics that were not collected. "
            f"Possible switches: any observer -> 'minmax' (all keep the running min/max), and between the "
            f"histogram-family observers {_histogram_names()} (they share one stored histogram). "
            f"Re-calibrate with activation={name!r} instead."
        )
    new = target(**options).to(observer.min_val.device)
    with torch.no_grad():
        if isinstance(new, HistogramObserverBase) and isinstance(observer, HistogramObserverBase) and observer.has_data:
            new.add_histogram(observer.stored_histogram(), float(observer.min_val), float(observer.max_val))
        for stat in _RUNNING_STATS:
            getattr(new, stat).copy_(getattr(observer, stat))
    new.label = observer.label
    new.enabled = observer.enabled
    return new

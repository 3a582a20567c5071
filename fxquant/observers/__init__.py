"""Observers: identity modules that collect the statistics quantization parameters are computed from."""

from fxquant.observers.base import Observer, WeightObserver
from fxquant.observers.registry import (
    activation_observer_names,
    get_activation_observer,
    get_weight_observer,
    register_observer,
    weight_observer_names,
)

__all__ = [
    "Observer",
    "WeightObserver",
    "activation_observer_names",
    "get_activation_observer",
    "get_weight_observer",
    "register_observer",
    "weight_observer_names",
]

"""Observers: identity modules that collect the statistics quantization parameters are computed from."""

from fxquant.observers.base import Observer, WeightObserver
from fxquant.observers.entropy import EntropyObserver
from fxquant.observers.hist_math import Histogram
from fxquant.observers.histogram import HistogramObserver, HistogramObserverBase
from fxquant.observers.minmax import MinMaxObserver
from fxquant.observers.moving_average import MovingAverageObserver
from fxquant.observers.mse import MseObserver
from fxquant.observers.percentile import PercentileObserver
from fxquant.observers.registry import (
    activation_observer_names,
    get_activation_observer,
    get_weight_observer,
    register_observer,
    weight_observer_names,
)
from fxquant.observers.switch import switch_method

__all__ = [
    "EntropyObserver",
    "Histogram",
    "HistogramObserver",
    "HistogramObserverBase",
    "MinMaxObserver",
    "MovingAverageObserver",
    "MseObserver",
    "Observer",
    "PercentileObserver",
    "WeightObserver",
    "activation_observer_names",
    "get_activation_observer",
    "get_weight_observer",
    "register_observer",
    "switch_method",
    "weight_observer_names",
]

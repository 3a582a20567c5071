"""The built-in observers, listed explicitly: the registry starts from these tables (each class carries its
registered ``name``); users add theirs with ``@register_observer``."""

from __future__ import annotations

from fxquant.observers.base import Observer, WeightObserver
from fxquant.observers.entropy import EntropyObserver
from fxquant.observers.histogram import HistogramObserver
from fxquant.observers.minmax import MinMaxObserver
from fxquant.observers.moving_average import MovingAverageObserver
from fxquant.observers.mse import MseObserver
from fxquant.observers.percentile import PercentileObserver
from fxquant.observers.weight import PerChannelWeightObserver, PerTensorWeightObserver

ACTIVATION: tuple[type[Observer], ...] = (MinMaxObserver, MovingAverageObserver, HistogramObserver,
                                          PercentileObserver, EntropyObserver, MseObserver)
WEIGHT: tuple[type[WeightObserver], ...] = (PerChannelWeightObserver, PerTensorWeightObserver)

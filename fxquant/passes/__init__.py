"""Graph passes: each takes an ``fx.GraphModule`` and returns it rewritten (lint-checked and recompiled)."""

from fxquant.passes._stats import StatisticsObserver
from fxquant.passes.bias_correction import InputMeanObserver, correct_biases, insert_bias_observers
from fxquant.passes.equalize import equalize_layers
from fxquant.passes.fold_bn import fold_batchnorm
from fxquant.passes.functional import functional_to_modules
from fxquant.passes.fuse import fuse_activations
from fxquant.passes.insert_observers import insert_observers
from fxquant.passes.keep_float import keep_layers_float
from fxquant.passes.lower import lower_to_int8
from fxquant.passes.smoothquant import ChannelRangeObserver, insert_smoothing_observers, smooth_activations
from fxquant.passes.smoothquant_auto import SmoothingChoice, smoothing_choices, smoothquant_alphas
from fxquant.passes.smoothquant_divide import ChannelScale

__all__ = [
    "ChannelRangeObserver",
    "ChannelScale",
    "InputMeanObserver",
    "SmoothingChoice",
    "StatisticsObserver",
    "correct_biases",
    "equalize_layers",
    "fold_batchnorm",
    "functional_to_modules",
    "fuse_activations",
    "insert_bias_observers",
    "insert_observers",
    "insert_smoothing_observers",
    "keep_layers_float",
    "lower_to_int8",
    "smooth_activations",
    "smoothing_choices",
    "smoothquant_alphas",
]

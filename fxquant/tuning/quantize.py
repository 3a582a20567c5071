"""``fxquant.quantize``: prepare, calibrate and convert in one call, or, given an accuracy budget, the search that
keeps the fewest layers float within it (:mod:`fxquant.tuning.budget`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from fxquant.api import convert, prepare
from fxquant.calibration import calibrate
from fxquant.config import QuantConfig
from fxquant.errors import ConfigError
from fxquant.tuning.budget import quantize_within_budget


def quantize(model: nn.Module, example_inputs: Any, data: Iterable[Any], config: QuantConfig | None = None, *,
             num_batches: int | None = None, progress: bool = True,
             eval_fn: Callable[[nn.Module], float] | None = None, max_accuracy_drop: float | None = None,
             max_trials: int = 16, max_relative_drop: float | None = None, higher_is_better: bool = True,
             fallback: str = "float", schemes: Mapping[str, str] | None = None,
             granularity: str = "layer") -> nn.Module:
    """``prepare`` + ``calibrate`` + ``convert(schemes=schemes)`` in one call. Example::

        qmodel = fxquant.quantize(model.eval(), (x,), loader, num_batches=32)

    With ``eval_fn`` (model -> metric; ``higher_is_better=False`` for perplexity or a loss) and a budget,
    ``max_accuracy_drop`` (in metric units) or ``max_relative_drop`` (in percent of the float metric), it moves the
    fewest layers to ``fallback`` (``"float"``, ``"weight_only"``, ``"dynamic"`` or ``"dynamic_group"``) that bring the
    drop within the budget, every trial starting from ``schemes``, one layer at a time or, ``granularity="kind"``, a
    layer of every repeated block at once, in at most ``max_trials`` conversions, and returns the best model found;
    ``fxquant.state.graph_of(qmodel).meta["fxquant_fallback"]`` holds every trial (see :mod:`fxquant.tuning.budget`)::

        qmodel = fxquant.quantize(model, (x,), loader, eval_fn=top1, max_accuracy_drop=0.005)
    """
    if eval_fn is not None or max_accuracy_drop is not None or max_relative_drop is not None:
        if eval_fn is None or (max_accuracy_drop is None and max_relative_drop is None):
            raise ConfigError("the accuracy-budget fallback needs both eval_fn (model -> metric) and a budget: "
                              "max_accuracy_drop (in metric units) or max_relative_drop (in percent of the float "
                              "metric)")
        return quantize_within_budget(model, example_inputs, data, config, eval_fn=eval_fn,
                                      max_accuracy_drop=max_accuracy_drop, max_relative_drop=max_relative_drop,
                                      higher_is_better=higher_is_better, fallback=fallback, schemes=schemes,
                                      granularity=granularity, max_trials=max_trials, num_batches=num_batches,
                                      progress=progress)
    search_only = {"fallback": fallback != "float", "granularity": granularity != "layer",
                   "higher_is_better": higher_is_better is not True}
    if any(search_only.values()):
        given = ", ".join(name for name, set_ in search_only.items() if set_)
        raise ConfigError(f"{given} only serve the accuracy-budget search: pass eval_fn and a budget "
                          "(max_accuracy_drop or max_relative_drop) too, or drop them")
    prepared = prepare(model, example_inputs, config)
    calibrate(prepared, data, num_batches=num_batches, progress=progress)
    return convert(prepared, schemes=schemes)

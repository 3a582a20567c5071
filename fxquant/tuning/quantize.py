"""``fxquant.quantize``: prepare, calibrate and convert in one call, or, given an accuracy budget, the search that
keeps the fewest layers float within it (:mod:`fxquant.tuning.budget`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
             max_trials: int = 16) -> nn.Module:
    """``prepare`` + ``calibrate`` + ``convert`` in one call. Example::

        qmodel = fxquant.quantize(model.eval(), (x,), loader, num_batches=32)

    With ``eval_fn`` (model -> metric, higher is better) and ``max_accuracy_drop`` (in metric units) it keeps the
    fewest layers float that bring the drop within the budget, in at most ``max_trials`` conversions, and returns
    the best model found; ``fxquant.state.graph_of(qmodel).meta["fxquant_fallback"]``
    holds every trial (see :mod:`fxquant.tuning.budget`)::

        qmodel = fxquant.quantize(model, (x,), loader, eval_fn=top1, max_accuracy_drop=0.005)
    """
    if eval_fn is not None or max_accuracy_drop is not None:
        if eval_fn is None or max_accuracy_drop is None:
            raise ConfigError("the accuracy-budget fallback needs both eval_fn (model -> metric, higher is better) "
                              "and max_accuracy_drop (in metric units)")

        return quantize_within_budget(model, example_inputs, data, config, eval_fn=eval_fn,
                                      max_accuracy_drop=max_accuracy_drop, max_trials=max_trials,
                                      num_batches=num_batches, progress=progress)
    prepared = prepare(model, example_inputs, config)
    calibrate(prepared, data, num_batches=num_batches, progress=progress)
    return convert(prepared)

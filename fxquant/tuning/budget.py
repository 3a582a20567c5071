"""Accuracy-budget fallback: keep the fewest layers float that bring the accuracy drop within a budget.

A trial-and-error tuner re-quantizes and re-evaluates blindly; this search spends its trials where they pay off:

1. calibrate once; trial 0 is everything INT8 (done if it already meets the budget);
2. rank layers by isolated SQNR (:mod:`fxquant.tuning.sensitivity`), the error each INT8 layer adds by itself;
3. confirm the ranking with leave-one-out trials on the top candidates (each keeps one layer float) and measure
   what each one really buys on the user's metric;
4. greedily keep layers float in order of confirmed gain until the budget is met, then try dropping each of them
   again (fewer float layers is faster);
5. stop after ``max_trials`` conversions in all. Every trial re-converts the same calibrated model with
   ``convert(prepared, keep_float=...)``: the observer statistics stay valid, only the lowering changes.

The chosen set is then quantized afresh with ``QuantConfig.exclude`` extended (one more calibration, when the data
can be iterated again), so the returned model saves and loads like any other; its own metric is the last row of the
table. The best model found is always returned (never nothing), with ``graph_of(qmodel).meta[FALLBACK_KEY]`` (the
GraphModule behind a drop-in model; ``qmodel.meta`` for a GraphModule) a :class:`FallbackResult` holding every
trial; if the budget cannot be met, the result says so and the model is the closest one.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from torch import fx, nn

from fxquant.api import check_example_inputs, convert, prepare
from fxquant.calibration import calibrate
from fxquant.calibration.adapters import iterate_batches
from fxquant.config import QuantConfig
from fxquant.errors import ConfigError
from fxquant.report.latency import measure_latency
from fxquant.state import graph_of
from fxquant.tuning.sensitivity import layer_sqnr

log = logging.getLogger(__name__)

FALLBACK_KEY = "fxquant_fallback"  # in the returned GraphModule's ``meta``
SENSITIVITY_BATCHES = 4  # calibration batches the per-layer SQNR ranking runs on
LATENCY_BUDGET_S = 0.5  # per trial: enough for a median on small models, small next to an evaluation
EvalFn = Callable[[nn.Module], float]


@dataclass(frozen=True)
class Trial:
    """One conversion the search evaluated."""

    step: str  # "all INT8", "leave-one-out", "greedy", "prune", "final"
    float_layers: tuple[str, ...]
    metric: float
    drop: float  # float metric - this metric, in metric units
    latency_ms: float
    met_budget: bool


@dataclass
class FallbackResult:
    """Every trial of an accuracy-budget search, and which one the returned model is."""

    float_metric: float
    max_accuracy_drop: float
    float_latency_ms: float
    config: QuantConfig  # the config with the chosen layers excluded: fxquant.quantize with it reproduces them
    trials: list[Trial] = field(default_factory=list)
    chosen: int = 0  # index in ``trials``
    sensitivity: dict[str, float] = field(default_factory=dict)  # isolated SQNR (dB), most sensitive first
    # the calibrated prepare() the returned model was converted from (with keep_float=float_layers): what an
    # artifact records, with that keep_float, to rebuild the returned model (the CLI writes both to RUN_DIR)
    prepared: fx.GraphModule | None = field(default=None, repr=False, compare=False)

    @property
    def best(self) -> Trial:
        return self.trials[self.chosen]

    @property
    def met_budget(self) -> bool:
        return self.best.met_budget

    @property
    def float_layers(self) -> tuple[str, ...]:
        return self.best.float_layers

    def to_markdown(self) -> str:
        lines = [f"float metric {self.float_metric:.4f}, budget: drop <= {self.max_accuracy_drop:g}, float latency "
                 f"{self.float_latency_ms:.3f} ms", "",
                 "| # | step | layers kept float | metric | drop | latency ms | within budget |",
                 "|---|---|---|---|---|---|---|"]
        for index, trial in enumerate(self.trials):
            mark = " (returned)" if index == self.chosen else ""
            lines.append(f"| {index}{mark} | {trial.step} | {', '.join(trial.float_layers) or '(none)'} | "
                         f"{trial.metric:.4f} | {trial.drop:+.4f} | {trial.latency_ms:.3f} | "
                         f"{'yes' if trial.met_budget else 'no'} |")
        verdict = (f"budget met with {len(self.float_layers)} float layer(s)" if self.met_budget else
                   "budget NOT met: returning the closest model found")
        return "\n".join([*lines, "", f"{verdict} (trial {self.chosen})."])

    def __str__(self) -> str:
        return self.to_markdown()


class _Search:
    """The trial bookkeeping of one search: converts, evaluates, times, and remembers every trial."""

    def __init__(self, prepared: fx.GraphModule, eval_fn: EvalFn, result: FallbackResult, max_trials: int,
                 example: tuple[Any, ...]) -> None:
        self.prepared, self.eval_fn, self.result, self.example = prepared, eval_fn, result, example
        self.max_trials = max_trials
        self.done: dict[frozenset[str], Trial] = {}

    @property
    def left(self) -> int:
        return self.max_trials - len(self.result.trials)

    def evaluate(self, model: nn.Module, step: str, layers: tuple[str, ...]) -> Trial:
        metric = float(self.eval_fn(model))
        drop = self.result.float_metric - metric
        latency = _latency_ms(model, self.example)
        trial = Trial(step, layers, metric, drop, latency, drop <= self.result.max_accuracy_drop)
        self.result.trials.append(trial)
        log.info("fallback trial %d (%s): float %s -> metric %.4f, drop %+.4f", len(self.result.trials) - 1, step,
                 list(layers) or "none", metric, drop)
        return trial

    def trial(self, layers: Iterable[str], step: str) -> Trial | None:
        """Convert with ``layers`` float and evaluate (cached); None when the trial budget is spent."""
        key = frozenset(layers)
        if key in self.done:
            return self.done[key]
        if self.left <= 0:
            return None
        ordered = tuple(sorted(key))
        self.done[key] = self.evaluate(convert(self.prepared, keep_float=ordered), step, ordered)
        return self.done[key]


def _latency_ms(model: nn.Module, example: tuple[Any, ...]) -> float:
    timing = measure_latency({"model": functools.partial(model, *example)}, warmup=2, min_runs=5, max_runs=50,
                             time_budget_s=LATENCY_BUDGET_S)
    return timing["model"].median


def _choose(trials: list[Trial]) -> int:
    """Fewest float layers among trials within budget (then the best metric); else the best metric."""
    met = [i for i, t in enumerate(trials) if t.met_budget]
    if met:
        return min(met, key=lambda i: (len(trials[i].float_layers), -trials[i].metric))
    return max(range(len(trials)), key=lambda i: trials[i].metric)


def _greedy(search: _Search, order: list[str]) -> list[str]:
    """Add layers in ``order`` until the budget is met; then drop the ones that are not needed."""
    chosen: list[str] = []
    for layer in order:
        chosen.append(layer)
        trial = search.trial(chosen, "greedy")
        if trial is None:
            return chosen
        if trial.met_budget:
            break
    else:
        return chosen
    for layer in list(chosen[:-1])[::-1]:  # least gain first: the likeliest to be unnecessary
        fewer = [name for name in chosen if name != layer]
        trial = search.trial(fewer, "prune")
        if trial is not None and trial.met_budget:
            chosen = fewer
    return chosen


def search_layers(search: _Search, sensitivity: dict[str, float]) -> None:
    """Steps 3-5 of the module docstring (trial 0 is done)."""
    ranked = list(sensitivity)
    baseline = search.result.trials[0].metric
    gains: dict[str, float] = {}
    for layer in ranked[:max(1, (search.max_trials - 1) // 2)]:
        trial = search.trial([layer], "leave-one-out")
        if trial is None:
            break
        gains[layer] = trial.metric - baseline
    if any(search.done[frozenset([layer])].met_budget for layer in gains):
        return
    confirmed = sorted(gains, key=lambda layer: -gains[layer])
    _greedy(search, confirmed + [layer for layer in ranked if layer not in gains])


def _reiterable(data: Iterable[Any]) -> bool:
    return not isinstance(data, Iterator)


def _refit(model: nn.Module, example: tuple[Any, ...], data: Iterable[Any], search: _Search,
           calibrate_fn: Callable[[fx.GraphModule, Iterable[Any]], object]) -> nn.Module:
    """Quantize afresh with the chosen layers excluded by config, so the model saves and loads as usual."""
    result = search.result
    result.chosen = _choose(result.trials)
    trial = result.best
    result.prepared = search.prepared
    if not trial.float_layers:
        return convert(search.prepared)
    result.config = replace(result.config, exclude=(*result.config.exclude, *trial.float_layers))
    if not _reiterable(data):
        log.warning("fallback: the data cannot be iterated again, so the returned model keeps layers float at "
                    "convert time; re-quantize with result.config for a model that fxquant.save can rebuild")
        return convert(search.prepared, keep_float=trial.float_layers)
    prepared = prepare(model, example, result.config)
    calibrate_fn(prepared, data)
    refit = convert(prepared, keep_float=trial.float_layers)  # see keep_float.py: exclude alone may not suffice
    final = search.evaluate(refit, "final (re-quantized with exclude)", trial.float_layers)
    if final.met_budget or final.metric >= trial.metric:
        result.chosen, result.prepared = len(result.trials) - 1, prepared
        return refit
    return convert(search.prepared, keep_float=trial.float_layers)


def _check(eval_fn: Any, max_accuracy_drop: Any, max_trials: Any) -> None:
    if not callable(eval_fn):
        raise ConfigError(f"eval_fn must be a callable model -> metric (higher is better), got {eval_fn!r}")
    if isinstance(max_accuracy_drop, bool) or not isinstance(max_accuracy_drop, (int, float)) or \
            not math.isfinite(max_accuracy_drop) or max_accuracy_drop < 0:
        raise ConfigError(f"max_accuracy_drop must be a number >= 0 in metric units (0.005 = 0.5 points of a "
                          f"fraction), got {max_accuracy_drop!r}")
    if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1:
        raise ConfigError(f"max_trials must be a positive integer, got {max_trials!r}")


def quantize_within_budget(model: nn.Module, example_inputs: Any, data: Iterable[Any],
                           config: QuantConfig | None = None, *, eval_fn: EvalFn, max_accuracy_drop: float,
                           max_trials: int = 16, num_batches: int | None = None,
                           progress: bool = True) -> nn.Module:
    """Quantize ``model`` keeping the fewest layers float so that ``eval_fn`` drops by at most ``max_accuracy_drop``.

    ``eval_fn(model) -> float`` scores any model (higher is better); the drop is in its units. At most
    ``max_trials`` conversions are evaluated (the final re-quantization comes on top). Returns the best model found;
    ``fxquant.state.graph_of(qmodel).meta[FALLBACK_KEY]`` is the :class:`FallbackResult` (``print(result)`` shows the
    trial table). This is what ``fxquant.quantize(..., eval_fn=..., max_accuracy_drop=...)`` and the CLI's
    ``--max-accuracy-drop`` call.
    Example::

        qmodel = quantize_within_budget(model, (x,), calib_loader, eval_fn=lambda m: accuracy(m, test_loader),
                                        max_accuracy_drop=0.005)
        print(graph_of(qmodel).meta["fxquant_fallback"])
    """
    _check(eval_fn, max_accuracy_drop, max_trials)
    config = config or QuantConfig()
    example = check_example_inputs(example_inputs)
    stream = iterate_batches(data)
    sample = list(itertools.islice(stream, SENSITIVITY_BATCHES))
    calibration_data = data if _reiterable(data) else itertools.chain(sample, stream)
    prepared = prepare(model, example, config)
    calibrate_fn = functools.partial(calibrate, num_batches=num_batches, progress=progress)
    calibrate_fn(prepared, calibration_data)
    result = FallbackResult(float(eval_fn(model)), float(max_accuracy_drop), _latency_ms(model, example), config)
    search = _Search(prepared, eval_fn, result, max_trials, example)
    baseline = search.trial([], "all INT8")
    assert baseline is not None
    if not baseline.met_budget:
        result.sensitivity = layer_sqnr(prepared, graph_of(convert(prepared)), sample)
        search_layers(search, result.sensitivity)
    qmodel = _refit(model, example, data, search, calibrate_fn)
    graph_of(qmodel).meta[FALLBACK_KEY] = result  # the GraphModule behind a drop-in model
    log.info("accuracy-budget fallback:\n%s", result.to_markdown())
    return qmodel

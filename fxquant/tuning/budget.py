"""Accuracy-budget fallback: move the fewest layers to a fallback so that the metric worsens by at most a budget.

A trial-and-error tuner re-quantizes and re-evaluates blindly; this search spends its trials where they pay off:

1. calibrate once; trial 0 is the base conversion (done if it already meets the budget);
2. rank the candidates by isolated SQNR (:mod:`fxquant.tuning.sensitivity`), the error each INT8 layer adds by itself;
3. confirm the ranking with leave-one-out trials on the top candidates (each moves one to the fallback) and measure
   what each one really buys on the user's metric;
4. greedily move candidates in order of confirmed gain until the budget is met, then try moving each of them back
   (fewer fallback layers is faster);
5. stop after ``max_trials`` conversions in all. Every trial re-converts the same calibrated model: the observer
   statistics stay valid, only the lowering changes.

The metric may improve either way: ``higher_is_better=False`` for perplexity or a loss. A trial's *drop* is how much
worse than the float model it is, in metric units, and the budget is ``max_accuracy_drop`` in those units or
``max_relative_drop``, in percent of the float metric (``1``: perplexity may rise by 1%, as in
``fxquant regress --max-relative-drop``).

The fallback of a layer is ``"float"`` (``convert(prepared, keep_float=...)``) or a more accurate INT8 scheme,
``"weight_only"``, ``"dynamic"`` or ``"dynamic_group"`` (``convert(prepared, schemes={layer: fallback, ...})``, Linears
only). Every trial starts from ``schemes``, the convert-time recipe of the base (``{"*": "dynamic"}``: a dynamic base,
the fallback layers listed first so theirs wins). ``granularity="kind"`` moves a layer in every repeated block at once
(each numeric part of the path a ``*``: ``model.layers.*.mlp.down_proj``), so a 30-block LLM has a handful of candidates
and the recipe reads as patterns.

The returned model: with a float fallback the chosen set is quantized afresh with ``QuantConfig.exclude`` extended
(one more calibration, when the data can be iterated again), its metric the last row of the table. With a scheme
fallback it is the chosen trial's conversion itself: ``convert`` records its schemes in the model's state, which
``fxquant.save``/``load`` and RUN_DIR replay, whereas re-preparing with per-layer ``scheme`` overrides would change
the model (SmoothQuant smooths layers calibrated static only). The best model found is always returned (never
nothing), with ``graph_of(qmodel).meta[FALLBACK_KEY]`` (the GraphModule behind a drop-in model; ``qmodel.meta`` for a
GraphModule) a :class:`FallbackResult` holding every trial, and ``meta[TRIALS_KEY]`` its report section
(:class:`~fxquant.report.trials.BudgetTrials`); if the budget cannot be met, the result says so and the model is the
closest one.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from torch import fx, nn

from fxquant.api import FLOAT_IO_SCHEMES, check_example_inputs, convert, prepare
from fxquant.calibration import calibrate
from fxquant.calibration.adapters import iterate_batches
from fxquant.config import QuantConfig
from fxquant.errors import ConfigError
from fxquant.report.latency import measure_latency
from fxquant.report.trials import TRIALS_KEY, BudgetTrials, Trial
from fxquant.state import graph_of
from fxquant.tuning.candidates import GRANULARITIES, candidates

log = logging.getLogger(__name__)

__all__ = ["FALLBACKS", "FALLBACK_KEY", "TRIALS_KEY", "FallbackResult", "Trial", "quantize_within_budget"]

FALLBACK_KEY = "fxquant_fallback"  # in the returned GraphModule's ``meta``
FALLBACKS = ("float", *FLOAT_IO_SCHEMES)  # what a layer can fall back to
SENSITIVITY_BATCHES = 4  # calibration batches the per-layer SQNR ranking runs on
LATENCY_BUDGET_S = 0.5  # per trial: enough for a median on small models, small next to an evaluation
EvalFn = Callable[[nn.Module], float]


class Conversion(NamedTuple):
    """The ``convert`` options of one trial."""

    keep_float: tuple[str, ...]
    schemes: dict[str, str]


@dataclass
class FallbackResult:
    """Every trial of an accuracy-budget search, and which one the returned model is."""

    float_metric: float
    max_accuracy_drop: float  # the budget in metric units (from ``max_relative_drop`` when given so)
    float_latency_ms: float
    config: QuantConfig  # float fallback: the chosen layers excluded, so fxquant.quantize with it reproduces them
    trials: list[Trial] = field(default_factory=list)
    chosen: int = 0  # index in ``trials``
    sensitivity: dict[str, float] = field(default_factory=dict)  # candidates' isolated SQNR (dB), most sensitive first
    # the calibrated prepare() the returned model was converted from (with conversion(best.layers)): what an artifact
    # records, with those convert options, to rebuild the returned model (the CLI writes both to RUN_DIR)
    prepared: fx.GraphModule | None = field(default=None, repr=False, compare=False)
    higher_is_better: bool = True
    max_relative_drop: float | None = None  # the budget as given, in percent of the float metric, when relative
    fallback: str = "float"  # one of FALLBACKS
    schemes: dict[str, str] = field(default_factory=dict)  # the base: convert(schemes=...) of every trial

    @property
    def best(self) -> Trial:
        return self.trials[self.chosen]

    @property
    def met_budget(self) -> bool:
        return self.best.met_budget

    @property
    def fallback_layers(self) -> tuple[str, ...]:
        """The layers (or kind patterns) the returned model runs on the fallback."""
        return self.best.layers

    @property
    def float_layers(self) -> tuple[str, ...]:
        """The layers the search kept float (none with a scheme fallback)."""
        return self.best.layers if self.fallback == "float" else ()

    def drop(self, metric: float) -> float:
        """How much worse ``metric`` is than the float model's, in metric units (negative: better)."""
        return self.float_metric - metric if self.higher_is_better else metric - self.float_metric

    def conversion(self, layers: Collection[str] | None = None) -> Conversion:
        """The ``convert`` options with ``layers`` (default: the returned model's) on the fallback: kept float, or
        their scheme listed before the base's patterns (the first match wins)."""
        layers = self.best.layers if layers is None else tuple(layers)
        if self.fallback == "float":
            return Conversion(tuple(layers), dict(self.schemes))
        moved = dict.fromkeys(layers, self.fallback)
        return Conversion((), {**moved, **{p: s for p, s in self.schemes.items() if p not in moved}})

    def section(self, metric: str = "metric") -> BudgetTrials:
        """The trials as a report section (what ``fxquant.report`` and RUN_DIR show), ``metric`` its name."""
        return BudgetTrials(self.float_metric, self.max_accuracy_drop, self.float_latency_ms, tuple(self.trials),
                            self.chosen, self.fallback, self.higher_is_better, self.max_relative_drop, metric,
                            dict(self.schemes))

    def to_markdown(self) -> str:
        return self.section().to_markdown()

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
        drop = self.result.drop(metric)
        latency = _latency_ms(model, self.example)
        trial = Trial(step, layers, metric, drop, latency, drop <= self.result.max_accuracy_drop)
        self.result.trials.append(trial)
        log.info("fallback trial %d (%s): %s %s -> metric %.4f, drop %+.4f", len(self.result.trials) - 1, step,
                 self.result.fallback, list(layers) or "none", metric, drop)
        return trial

    def trial(self, layers: Iterable[str], step: str) -> Trial | None:
        """Convert with ``layers`` on the fallback and evaluate (cached); None when the trial budget is spent."""
        key = frozenset(layers)
        if key in self.done:
            return self.done[key]
        if self.left <= 0:
            return None
        ordered = tuple(sorted(key))
        model = convert(self.prepared, **self.result.conversion(ordered)._asdict())
        self.done[key] = self.evaluate(model, step, ordered)
        return self.done[key]


def _latency_ms(model: nn.Module, example: tuple[Any, ...]) -> float:
    timing = measure_latency({"model": functools.partial(model, *example)}, warmup=2, min_runs=5, max_runs=50,
                             time_budget_s=LATENCY_BUDGET_S)
    return timing["model"].median


def _choose(trials: list[Trial]) -> int:
    """Fewest fallback layers among trials within budget (then the smallest drop); else the smallest drop."""
    met = [i for i, t in enumerate(trials) if t.met_budget]
    if met:
        return min(met, key=lambda i: (len(trials[i].layers), trials[i].drop))
    return min(range(len(trials)), key=lambda i: trials[i].drop)


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
    baseline = search.result.trials[0].drop
    gains: dict[str, float] = {}
    for layer in ranked[:max(1, (search.max_trials - 1) // 2)]:
        trial = search.trial([layer], "leave-one-out")
        if trial is None:
            break
        gains[layer] = baseline - trial.drop
    if any(search.done[frozenset([layer])].met_budget for layer in gains):
        return
    confirmed = sorted(gains, key=lambda layer: -gains[layer])
    _greedy(search, confirmed + [layer for layer in ranked if layer not in gains])


def _reiterable(data: Iterable[Any]) -> bool:
    return not isinstance(data, Iterator)


def _refit(model: nn.Module, example: tuple[Any, ...], data: Iterable[Any], search: _Search,
           calibrate_fn: Callable[[fx.GraphModule, Iterable[Any]], object]) -> nn.Module:
    """The chosen trial's model; with a float fallback quantized afresh with the chosen layers excluded by config,
    so the config alone reproduces it (see the module docstring)."""
    result = search.result
    result.chosen = _choose(result.trials)
    trial = result.best
    result.prepared = search.prepared
    conversion = result.conversion()._asdict()
    if result.fallback != "float" or not trial.layers:
        return convert(search.prepared, **conversion)
    result.config = replace(result.config, exclude=(*result.config.exclude, *trial.layers))
    if not _reiterable(data):
        log.warning("fallback: the data cannot be iterated again, so the returned model keeps layers float at "
                    "convert time; re-quantize with result.config for a model that fxquant.save can rebuild")
        return convert(search.prepared, **conversion)
    prepared = prepare(model, example, result.config)
    calibrate_fn(prepared, data)
    refit = convert(prepared, **conversion)  # see keep_float.py: exclude alone may not suffice
    final = search.evaluate(refit, "final (re-quantized with exclude)", trial.layers)
    if final.met_budget or final.drop <= trial.drop:
        result.chosen, result.prepared = len(result.trials) - 1, prepared
        return refit
    return convert(search.prepared, **conversion)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _check_budget(eval_fn: Any, max_accuracy_drop: Any, max_relative_drop: Any, max_trials: Any) -> None:
    if not callable(eval_fn):
        raise ConfigError(f"eval_fn must be a callable model -> metric, got {eval_fn!r}")
    if (max_accuracy_drop is None) == (max_relative_drop is None):
        raise ConfigError("give one budget: max_accuracy_drop (in metric units) or max_relative_drop (in percent of "
                          f"the float metric), got {max_accuracy_drop!r} and {max_relative_drop!r}")
    if max_accuracy_drop is not None and not _number(max_accuracy_drop):
        raise ConfigError(f"max_accuracy_drop must be a number >= 0 in metric units (0.005 = 0.5 points of a "
                          f"fraction), got {max_accuracy_drop!r}")
    if max_relative_drop is not None and not _number(max_relative_drop):
        raise ConfigError(f"max_relative_drop must be a number >= 0, in percent of the float metric (1: 1% "
                          f"worse), got {max_relative_drop!r}")
    if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 1:
        raise ConfigError(f"max_trials must be a positive integer, got {max_trials!r}")


def _check_fallback(fallback: Any, schemes: Any, granularity: Any) -> dict[str, str]:
    if fallback == "static":
        raise ConfigError("fallback='static': a layer falls back to something more accurate than static W8A8, "
                          f"which convert can switch it to without calibrating again: one of {', '.join(FALLBACKS)}")
    if fallback not in FALLBACKS:
        raise ConfigError(f"unknown fallback {fallback!r}; use one of {', '.join(FALLBACKS)}")
    if granularity not in GRANULARITIES:
        raise ConfigError(f"unknown granularity {granularity!r}; use one of {', '.join(GRANULARITIES)}")
    if schemes is None:
        return {}
    if not isinstance(schemes, Mapping) or any(v not in FLOAT_IO_SCHEMES for v in schemes.values()):
        raise ConfigError(f"schemes must map module path patterns to one of {', '.join(FLOAT_IO_SCHEMES)} (the "
                          f"convert(schemes=...) every trial starts from), got {schemes!r}")
    return {str(pattern): scheme for pattern, scheme in schemes.items()}


def quantize_within_budget(model: nn.Module, example_inputs: Any, data: Iterable[Any],
                           config: QuantConfig | None = None, *, eval_fn: EvalFn,
                           max_accuracy_drop: float | None = None, max_relative_drop: float | None = None,
                           higher_is_better: bool = True, fallback: str = "float",
                           schemes: Mapping[str, str] | None = None, granularity: str = "layer",
                           max_trials: int = 16, num_batches: int | None = None, progress: bool = True) -> nn.Module:
    """Quantize ``model`` moving the fewest layers to ``fallback`` so that ``eval_fn`` worsens by at most the budget.

    ``eval_fn(model) -> float`` scores any model (``higher_is_better=False`` for perplexity or a loss). The budget is
    ``max_accuracy_drop`` in its units or ``max_relative_drop`` in percent of the float model's value (give one).
    ``fallback``: ``"float"``, ``"weight_only"``, ``"dynamic"`` or ``"dynamic_group"``; ``schemes``: the
    ``convert(schemes=...)`` every trial starts from; ``granularity``: ``"layer"`` or ``"kind"`` (a layer in every
    repeated block at once). At most ``max_trials`` conversions are evaluated (the final re-quantization comes on top).
    Returns the best model found; ``fxquant.state.graph_of(qmodel).meta[FALLBACK_KEY]`` is the :class:`FallbackResult`
    (``print(result)`` shows the trial table). This is what ``fxquant.quantize(..., eval_fn=...,
    max_accuracy_drop=...)`` and the CLI's ``--max-accuracy-drop`` call. Example (perplexity within +1%, a dynamic base
    with weight-only fallback)::

        qmodel = quantize_within_budget(model, (ids,), windows, QuantConfig(scheme="static", smoothquant_alpha=0.4),
                                        eval_fn=lambda m: perplexity(m, test), higher_is_better=False,
                                        max_relative_drop=1, fallback="weight_only", schemes={"*": "dynamic"},
                                        granularity="kind")
        print(graph_of(qmodel).meta["fxquant_fallback"])
    """
    _check_budget(eval_fn, max_accuracy_drop, max_relative_drop, max_trials)
    base = _check_fallback(fallback, schemes, granularity)
    config = config or QuantConfig()
    example = check_example_inputs(example_inputs)
    stream = iterate_batches(data)
    sample = list(itertools.islice(stream, SENSITIVITY_BATCHES))
    calibration_data = data if _reiterable(data) else itertools.chain(sample, stream)
    prepared = prepare(model, example, config)
    calibrate_fn = functools.partial(calibrate, num_batches=num_batches, progress=progress)
    calibrate_fn(prepared, calibration_data)
    float_metric = float(eval_fn(model))
    budget = max_relative_drop / 100 * abs(float_metric) if max_relative_drop is not None else max_accuracy_drop
    assert budget is not None  # _check_budget: exactly one is given
    result = FallbackResult(float_metric, float(budget), _latency_ms(model, example), config,
                            higher_is_better=bool(higher_is_better), max_relative_drop=max_relative_drop,
                            fallback=fallback, schemes=base)
    search = _Search(prepared, eval_fn, result, max_trials, example)
    baseline = search.trial([], "all INT8" if not base else "base schemes")
    assert baseline is not None
    if not baseline.met_budget:
        result.sensitivity = candidates(prepared, convert(prepared, schemes=base), sample, fallback, granularity)
        if not result.sensitivity:
            log.warning("fallback: no INT8 layer of the base model can fall back to %r", fallback)
        search_layers(search, result.sensitivity)
    qmodel = _refit(model, example, data, search, calibrate_fn)
    graph_of(qmodel).meta[FALLBACK_KEY] = result  # the GraphModule behind a drop-in model
    graph_of(qmodel).meta[TRIALS_KEY] = result.section()
    log.info("accuracy-budget fallback:\n%s", result.to_markdown())
    return qmodel

"""One pass over the evaluation data: both models on every batch, metric and output fidelity accumulated.

The float and the quantized model see the very same batch one after the other, so the fidelity figures compare
outputs of identical inputs; the first batches also feed the per-layer probe.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from fxquant.calibration.adapters import batch_size_of, forward_parameters, iterate_batches, to_call_args
from fxquant.errors import FxQuantError, InputError
from fxquant.report.layers import LayerProbe
from fxquant.report.metrics import FidelityMeter, Metric, WeightedMean, metric_value, split_batch
from fxquant.report.sections import Accuracy, Fidelity
from fxquant.state import graph_of

CallArgs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Evaluation:
    """What one pass over the data measured, plus the first batch's inputs (reused to time the models)."""

    accuracy: Accuracy
    fidelity: Fidelity
    first_inputs: CallArgs
    batch_size: int


@dataclass(frozen=True)
class EvalPlan:
    """How much of the data to use: ``max_batches`` for the metric, ``layer_batches`` for the per-layer probe."""

    metric: Metric
    max_batches: int | None = None
    layer_batches: int = 4
    progress: bool = True
    higher_is_better: bool = True


def _length(data: object, limit: int | None) -> int | None:
    try:
        total = len(data)  # type: ignore[arg-type]
    except TypeError:
        return limit
    return total if limit is None else min(total, limit)


def _run(model: nn.Module, index: int, inputs: CallArgs, which: str) -> Any:
    try:
        return model(*inputs[0], **inputs[1])
    except FxQuantError:
        raise
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"evaluation batch {index} does not fit the {which} model: {reason}") from exc


def _samples(target: Any, call: CallArgs) -> int:
    """The batch's weight in the metric's mean: the number of targets, else the inputs' batch size."""
    return len(target) if isinstance(target, torch.Tensor) and target.dim() else batch_size_of(*call)


@torch.inference_mode()
def score(model: nn.Module, data: Iterable[Any], metric: Metric, params: list[str]) -> float:
    """``metric`` of ``model`` over every batch of ``data`` (sample-weighted mean), dict batches bound to the
    forward parameter names ``params``: what the accuracy-budget search ranks models by. Errors as in
    :func:`evaluate`."""
    mean = WeightedMean()
    for index, batch in enumerate(iterate_batches(data)):
        inputs, target = split_batch(batch, metric.needs_target)
        call = to_call_args(inputs, params)
        mean.add(metric_value(metric, _run(model, index, call, "evaluated"), target), _samples(target, call))
    if not mean.weight:
        raise InputError("eval_data yielded no batch; pass a non-empty iterable of (inputs, target) batches")
    return metric.finish(mean.mean)


@torch.inference_mode()
def evaluate(float_model: nn.Module, quantized: nn.Module, data: Iterable[Any], plan: EvalPlan,
             probe: LayerProbe | None = None) -> Evaluation:
    """Run every batch (up to ``plan.max_batches``) through both models; see :class:`EvalPlan`."""
    params, _ = forward_parameters(graph_of(quantized))  # the placeholders: a drop-in model's graph's
    scores = {"float": WeightedMean(), "quantized": WeightedMean()}
    meter = FidelityMeter()
    first: CallArgs | None = None
    batches = itertools.islice(iterate_batches(data), plan.max_batches)
    bar = tqdm(batches, total=_length(data, plan.max_batches), desc="evaluating", unit="batch", file=sys.stderr,
               disable=not plan.progress, leave=False)
    with bar:
        for index, batch in enumerate(bar):
            inputs, target = split_batch(batch, plan.metric.needs_target)
            call = to_call_args(inputs, params)
            first = first or call
            outputs = {"float": _run(float_model, index, call, "float"),
                       "quantized": _run(quantized, index, call, "quantized")}
            samples = _samples(target, call)
            for name, out in outputs.items():
                scores[name].add(metric_value(plan.metric, out, target), samples)
            meter.update(outputs["float"], outputs["quantized"], samples)
            if probe is not None and index < plan.layer_batches:
                probe.observe(*call)
    if first is None:
        raise InputError("eval_data yielded no batch; pass a non-empty iterable of (inputs, target) batches")
    finish = plan.metric.finish
    accuracy = Accuracy(plan.metric.name, finish(scores["float"].mean), finish(scores["quantized"].mean),
                        meter.samples, plan.higher_is_better and plan.metric.higher_is_better,
                        plan.metric.points_per_unit)
    return Evaluation(accuracy, meter.result(), first, batch_size_of(*first))

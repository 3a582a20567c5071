"""``fxquant.report``: measure what quantization did to a model (accuracy, fidelity, latency, size, layers).

Users quantize to get speed at a known accuracy cost; this function measures both in one run on the user's own
data, and the :class:`~fxquant.report.schema.Report` it returns is what the regression gate compares release to
release.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fxquant.errors import ConfigError, InputError, TraceError
from fxquant.report.environment import describe_environment
from fxquant.report.evaluate import EvalPlan, evaluate
from fxquant.report.latency import measure_batch_sizes
from fxquant.report.layers import LayerProbe
from fxquant.report.metrics import MetricFn, resolve_metric
from fxquant.report.schema import Report
from fxquant.report.sections import Latency, LatencyPoint, Size
from fxquant.report.size import serialized_size
from fxquant.report.trials import budget_trials
from fxquant.state import QuantState, graph_of, quant_state


def _check_models(float_model: nn.Module, quantized: nn.Module) -> QuantState:
    if not isinstance(float_model, nn.Module):
        raise InputError(f"float_model must be a torch.nn.Module, got {type(float_model).__name__}")
    if float_model.training:
        raise InputError(f"{type(float_model).__name__} is in training mode; call float_model.eval() first so "
                         "BatchNorm and dropout behave as in the quantized model")
    state = quant_state(quantized)
    if state.stage != "converted":
        raise InputError(f"report() compares a converted model with its float model, got a {state.stage!r} "
                         "model; call fxquant.convert(prepared) first")
    return state


def _check_options(batch_sizes: Sequence[int] | None, threads: int | None, latency_budget_s: float) -> None:
    if batch_sizes is not None and (not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes)):
        raise ConfigError(f"batch_sizes must be a non-empty list of positive integers, got {batch_sizes!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be a positive integer, got {threads!r}")
    if not latency_budget_s > 0:
        raise ConfigError(f"latency_budget_s must be > 0 seconds, got {latency_budget_s!r}")


def _probe(float_model: nn.Module, quantized: nn.Module, state: QuantState) -> LayerProbe | None:
    """The per-layer probe, which needs the float model traced whole: a model whose root does not trace (a drop-in
    model of INT8 islands, such as a Hugging Face ``...ForCausalLM``) is reported without per-layer rows (the
    Markdown says so; ``fxquant.coverage`` lists its layers)."""
    try:
        return LayerProbe(float_model, graph_of(quantized), state)  # a drop-in model: the graph behind it
    except TraceError:
        return None


def report(float_model: nn.Module, quantized: nn.Module, eval_data: Iterable[Any], *,
           metric: str | MetricFn = "top1", batch_sizes: Sequence[int] | None = None, threads: int | None = None,
           latency_budget_s: float = 10.0, progress: bool = True, max_batches: int | None = None,
           layer_batches: int = 4, higher_is_better: bool = True) -> Report:
    """Compare ``quantized`` (from ``fxquant.convert``) with ``float_model`` on ``eval_data``.

    * ``metric``: ``"top1"``/``"top5"`` (batches yield ``(inputs, target)``; values are fractions),
      ``"perplexity"`` (a causal LM; batches yield ``(input_ids, input_ids)`` windows of equal length; lower is
      better) or a callable ``metric(outputs, targets)`` / ``metric(outputs)`` returning one number per batch;
      reduced over the data as a sample-weighted mean. ``higher_is_better=False`` for losses/error rates (then
      ``drop`` is the increase).
    * Output fidelity (SQNR, cosine similarity, max abs error of quantized vs float outputs) is always measured.
    * Latency: both models interleaved in one run with ``threads`` threads (default: torch's current count) at each of
      ``batch_sizes`` (default: the first eval batch's size), within ``latency_budget_s`` seconds in total.
    * Per layer: every Linear/Conv of ``float_model``, measured on the first ``layer_batches`` batches.
    * ``max_batches`` limits the evaluation; ``progress`` shows a bar on stderr.

    Example::

        qmodel = fxquant.quantize(model, (x,), calib_loader)
        report = fxquant.report(model, qmodel, test_loader, metric="top1", threads=1)
        print(report.to_markdown())
    """
    state = _check_models(float_model, quantized)
    _check_options(batch_sizes, threads, latency_budget_s)
    threads = threads or torch.get_num_threads()
    plan = EvalPlan(resolve_metric(metric), max_batches, max(0, layer_batches), progress, higher_is_better)
    probe = _probe(float_model, quantized, state)
    evaluation = evaluate(float_model, quantized, eval_data, plan, probe)
    timings = measure_batch_sizes({"float": float_model, "quantized": quantized}, evaluation.first_inputs,
                                  list(batch_sizes or [evaluation.batch_size]), time_budget_s=latency_budget_s,
                                  threads=threads)
    points = tuple(LatencyPoint(size, stats["float"], stats["quantized"]) for size, stats in timings)
    return Report(
        backend=state.backend or state.config.backend, observer=state.config.activation,
        accuracy=evaluation.accuracy, latency=Latency(points, threads),
        size=Size(serialized_size(float_model), serialized_size(quantized)),
        layers=tuple(probe.results() if probe else ()),
        fidelity=evaluation.fidelity, environment=describe_environment(state, threads),
        budget_search=budget_trials(quantized),
    )

"""Task metrics and output fidelity, accumulated batch by batch so evaluation never holds the whole data set.

Reduction: a metric returns one number per batch (for the built-ins, the fraction of the batch classified right);
the report's value is the *sample-weighted mean* over batches, ``sum(value_b * n_b) / sum(n_b)`` with ``n_b`` the
batch's number of samples, so a per-batch mean metric gives the exact mean over samples whatever the batch sizes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fxquant.errors import ConfigError, InputError
from fxquant.models.corpus import next_token_losses
from fxquant.report.sections import TOPK_POINTS, Fidelity

MetricFn = Callable[..., Any]
TARGET_KEYS = ("labels", "label", "targets", "target")


def topk_accuracy(outputs: torch.Tensor, targets: torch.Tensor, k: int) -> float:
    """Fraction of rows whose target class is among the ``k`` highest logits (``k`` capped at the class count).

    ``targets`` holds class indices, or one-hot / probability rows (their argmax is the class).
    """
    if targets.dim() == outputs.dim():
        targets = targets.argmax(dim=-1)
    k = min(k, outputs.shape[-1])
    top = outputs.topk(k, dim=-1).indices
    return float((top == targets.unsqueeze(-1)).any(dim=-1).float().mean())


def top1(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Top-1 accuracy of one batch, as a fraction in [0, 1]."""
    return topk_accuracy(outputs, targets, 1)


def top5(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Top-5 accuracy of one batch, as a fraction in [0, 1]."""
    return topk_accuracy(outputs, targets, 5)


def next_token_nll(outputs: Any, targets: torch.Tensor) -> float:
    """Mean next-token negative log-likelihood (nats) of a causal LM's logits for the token ids ``targets`` (the
    batch's own ``input_ids``): the per-batch value the ``perplexity`` metric averages before its ``exp``."""
    return float(next_token_losses(outputs, targets).double().mean())


METRICS: dict[str, MetricFn] = {"top1": top1, "top5": top5, "perplexity": next_token_nll}


def _identity(value: float) -> float:
    return value


@dataclass(frozen=True)
class Metric:
    """A metric resolved from a name or a callable: how to call it and how to compare its values.

    ``finish`` maps the sample-weighted mean of the per-batch values to the reported value: ``exp`` for perplexity,
    whose per-batch value is the mean next-token NLL (every window of a text has the same number of tokens, so the
    sample-weighted mean is the mean over tokens). ``higher_is_better`` is False for perplexity and losses.
    """

    name: str
    fn: MetricFn
    needs_target: bool
    points_per_unit: float = 1.0
    higher_is_better: bool = True
    finish: Callable[[float], float] = _identity


def _required_positional(fn: MetricFn) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: assume (outputs, targets)
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in params)


def resolve_metric(metric: str | MetricFn) -> Metric:
    """``"top1"``/``"top5"``/``"perplexity"`` or a callable ``metric(outputs, targets)`` / ``metric(outputs)``."""
    if isinstance(metric, str):
        if metric not in METRICS:
            raise ConfigError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)} or pass a callable "
                              "metric(outputs, targets) -> float")
        if metric == "perplexity":
            return Metric(metric, METRICS[metric], needs_target=True, higher_is_better=False, finish=math.exp)
        return Metric(metric, METRICS[metric], needs_target=True, points_per_unit=TOPK_POINTS)
    if not callable(metric):
        raise ConfigError(f"metric must be a name ({', '.join(METRICS)}) or a callable, got {type(metric).__name__}")
    required = _required_positional(metric)
    if required not in (1, 2):
        raise ConfigError(f"metric {metric!r} must take (outputs, targets) or (outputs); it requires {required} "
                          "positional arguments")
    return Metric(getattr(metric, "__name__", type(metric).__name__), metric, needs_target=required == 2)


def split_batch(batch: Any, needs_target: bool) -> tuple[Any, Any]:
    """``(model inputs, target)``: the target is a tuple/list batch's last item or a dict batch's label key."""
    if not needs_target:
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        inputs = batch[0] if len(batch) == 2 else tuple(batch[:-1])
        return inputs, batch[-1]
    if isinstance(batch, Mapping):
        key = next((k for k in TARGET_KEYS if k in batch), None)
        if key is not None:
            return {k: v for k, v in batch.items() if k != key}, batch[key]
    raise InputError(f"the metric needs targets, but a batch is a {type(batch).__name__}; yield (inputs, target) "
                     f"tuples or dicts with one of the keys {', '.join(TARGET_KEYS)}, or pass a metric(outputs)")


def metric_value(metric: Metric, outputs: Any, target: Any) -> float:
    value = metric.fn(outputs, target) if metric.needs_target else metric.fn(outputs)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"metric {metric.name!r} returned {type(value).__name__}; it must return one number per "
                         "batch (a float or a 0-d tensor)") from None


class WeightedMean:
    """Sample-weighted mean of per-batch values (see the module docstring)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.weight = 0

    def add(self, value: float, weight: int) -> None:
        self.total += value * weight
        self.weight += weight

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight else float("nan")


def output_tensors(outputs: Any) -> torch.Tensor:
    """Every floating tensor in a model's outputs (tensor, tuple/list, dict), flattened into one float64 vector."""
    empty = torch.empty(0, dtype=torch.float64)
    if isinstance(outputs, torch.Tensor):
        return outputs.detach().reshape(-1).double() if outputs.is_floating_point() else empty
    if isinstance(outputs, Mapping):
        outputs = list(outputs.values())
    if not isinstance(outputs, (tuple, list)):
        return empty
    return torch.cat([empty, *(output_tensors(v) for v in outputs)])


class FidelityMeter:
    """SQNR, cosine similarity and max abs error of approximations against references, over all elements seen."""

    def __init__(self) -> None:
        self.signal = self.noise = self.dot = self.approx_energy = self.max_error = 0.0
        self.samples = 0

    def update(self, reference: Any, approx: Any, samples: int) -> None:
        ref, out = output_tensors(reference), output_tensors(approx)
        if ref.shape != out.shape:
            raise InputError(f"float and quantized outputs differ in size ({ref.numel()} vs {out.numel()} "
                             "elements); report() needs both models to return the same structure")
        diff = ref - out
        self.signal += float(ref.pow(2).sum())
        self.noise += float(diff.pow(2).sum())
        self.dot += float((ref * out).sum())
        self.approx_energy += float(out.pow(2).sum())
        self.max_error = max(self.max_error, float(diff.abs().max()) if diff.numel() else 0.0)
        self.samples += samples

    def result(self) -> Fidelity:
        denominator = math.sqrt(self.signal * self.approx_energy)
        cosine = self.dot / denominator if denominator else 1.0
        return Fidelity(energy_ratio_db(self.signal, self.noise), cosine, self.max_error, self.samples)


def energy_ratio_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``: the SQNR of accumulated energies (inf when there is no noise)."""
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf

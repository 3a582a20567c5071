"""Metrics against hand-computed values: top1/top5, callables with and without targets, the weighted reduction."""

from __future__ import annotations

import math

import pytest
import torch
from report_helpers import digits_model, digits_qmodel
from torch import fx, nn

import fxquant
from fxquant.errors import ConfigError, InputError
from fxquant.report.evaluate import EvalPlan, evaluate
from fxquant.report.metrics import FidelityMeter, WeightedMean, resolve_metric, split_batch, top1, top5

# 3 samples, 6 classes. Ranks of the target (1 = highest logit): 1, 2, 6.
LOGITS = torch.tensor([[9.0, 1, 2, 3, 4, 5], [1.0, 2, 9, 3, 4, 5], [6.0, 5, 4, 3, 2, 1]])
TARGETS = torch.tensor([0, 5, 5])


def test_topk_against_hand_computed_values() -> None:
    assert top1(LOGITS, TARGETS) == pytest.approx(1 / 3)  # only sample 0 has its target first
    assert top5(LOGITS, TARGETS) == pytest.approx(2 / 3)  # sample 2's target is ranked 6th
    assert top1(LOGITS, nn.functional.one_hot(TARGETS, 6)) == pytest.approx(1 / 3)  # one-hot targets work too
    assert top5(LOGITS[:, :3], torch.tensor([2, 0, 1])) == 1.0  # k is capped at the number of classes


class Identity(nn.Module):
    """Outputs its input: the "logits" are the data, so every metric value is known in advance."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _evaluate(batches: list, metric: object, **plan: object) -> object:
    model = Identity().eval()
    gm = fx.symbolic_trace(model)
    return evaluate(model, gm, batches, EvalPlan(resolve_metric(metric), progress=False, **plan))  # type: ignore


def test_reduction_is_the_sample_weighted_mean_over_batches() -> None:
    # batch 1: 3 samples, top1 = 1/3; batch 2: 1 sample, top1 = 1. Weighted: (1/3 * 3 + 1 * 1) / 4 = 1/2
    batches = [(LOGITS, TARGETS), (LOGITS[:1], TARGETS[:1])]
    evaluation = _evaluate(batches, "top1")
    assert evaluation.accuracy.float_value == pytest.approx(0.5)  # type: ignore[attr-defined]
    assert evaluation.accuracy.samples == 4 and evaluation.accuracy.drop == 0  # type: ignore[attr-defined]


def test_callable_metrics_with_and_without_targets() -> None:
    def mean_logit_of_target(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return outputs.gather(1, targets[:, None]).mean()

    batches = [(LOGITS, TARGETS), (LOGITS[:1], TARGETS[:1])]
    # batch 1: (9 + 5 + 1) / 3 = 5, batch 2: 9 -> (5 * 3 + 9) / 4 = 6
    with_targets = _evaluate(batches, mean_logit_of_target).accuracy  # type: ignore[attr-defined]
    assert with_targets.float_value == pytest.approx(6.0) and with_targets.metric == "mean_logit_of_target"
    assert with_targets.points_per_unit == 1.0

    def max_logit(outputs: torch.Tensor) -> float:
        return float(outputs.max(dim=1).values.mean())

    # outputs only: batches are plain tensors. batch 1: (9 + 9 + 6) / 3 = 8, batch 2: 9 -> (8 * 3 + 9) / 4 = 8.25
    alone = _evaluate([LOGITS, LOGITS[:1]], max_logit).accuracy  # type: ignore[attr-defined]
    assert alone.float_value == pytest.approx(8.25)


def test_lower_is_better_metrics_report_the_increase_as_drop() -> None:
    accuracy = _evaluate([(LOGITS, TARGETS)], lambda out, target: 0.5, higher_is_better=False).accuracy  # type: ignore
    assert accuracy.drop == 0 and not accuracy.higher_is_better


def test_fidelity_against_hand_computed_values() -> None:
    meter = FidelityMeter()
    meter.update(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0]), samples=1)
    meter.update((torch.tensor([0.0]),), (torch.tensor([0.0]),), samples=1)  # tuples of outputs are flattened
    result = meter.result()
    assert result.sqnr_db == pytest.approx(10 * math.log10(25 / 1))
    assert result.cosine_similarity == pytest.approx((9 + 12) / (5 * math.sqrt(18)))
    assert result.max_abs_error == 1.0 and result.samples == 2
    exact = FidelityMeter()
    exact.update(torch.ones(3), torch.ones(3), samples=3)
    assert exact.result().sqnr_db == math.inf


def test_weighted_mean_and_batch_splitting() -> None:
    mean = WeightedMean()
    mean.add(1.0, 1)
    mean.add(0.0, 3)
    assert mean.mean == 0.25
    images, labels = torch.zeros(2, 3), torch.tensor([1, 2])
    assert split_batch({"x": images, "labels": labels}, True)[1] is labels
    assert split_batch((images, images, labels), True)[0] == (images, images)
    with pytest.raises(InputError, match="needs targets"):
        split_batch(images, True)


def test_bad_metrics_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="top1, top5"):
        resolve_metric("top3")
    with pytest.raises(ConfigError, match="requires 3"):
        resolve_metric(lambda a, b, c: 0.0)


def test_report_reads_dict_batches() -> None:
    from fxquant.models.digits import load_digits_splits

    images, labels = load_digits_splits()["test"]
    batches = [{"x": images[:32], "labels": labels[:32]}]
    report = fxquant.report(digits_model(), digits_qmodel(), batches, threads=1, latency_budget_s=0.1, progress=False,
                            layer_batches=1)
    with torch.no_grad():
        expected = float((digits_model()(images[:32]).argmax(1) == labels[:32]).float().mean())
    assert report.accuracy.float_value == pytest.approx(expected)
    assert all(layer.sqnr_db is not None for layer in report.layers)

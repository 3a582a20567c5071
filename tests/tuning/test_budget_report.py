"""Every trial of the budget search in ``fxquant.report``: the section, its JSON round trip and both renderers."""

from __future__ import annotations

import json

import pytest
import torch
from budget_testing import MLP, mlp_data, synthetic_loss

import fxquant
from fxquant.errors import ArtifactError
from fxquant.report.schema import Report
from fxquant.report.trials import BudgetTrials, recorded_trials
from fxquant.tuning.budget import FALLBACK_KEY

COSTS = {"fc1": 0.010, "fc2": 0.001, "fc3": 0.008, "fc4": 0.001}


def _report(qmodel: torch.nn.Module, model: torch.nn.Module) -> Report:
    generator = torch.Generator().manual_seed(1)
    data = [(x, torch.randint(0, 4, (16,), generator=generator)) for x in mlp_data()]
    return fxquant.report(model, qmodel, data, metric="top1", latency_budget_s=0.05, progress=False, threads=1)


@pytest.fixture(scope="module")
def searched() -> tuple[torch.nn.Module, torch.nn.Module]:
    model, data = MLP().eval(), mlp_data()
    qmodel = fxquant.quantize(model, (data[0],), data, eval_fn=synthetic_loss(COSTS), higher_is_better=False,
                              max_accuracy_drop=0.005, fallback="weight_only", max_trials=12, progress=False)
    return model, qmodel


def test_the_report_lists_every_trial_and_round_trips(searched: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    model, qmodel = searched
    result = qmodel.meta[FALLBACK_KEY]
    report = _report(qmodel, model)
    assert report.budget_search == result.section() and len(report.budget_search.trials) == len(result.trials) > 1
    again = Report.from_json(report.to_json())
    assert again.budget_search == report.budget_search
    markdown = report.to_markdown()
    assert "### Accuracy-budget search (every trial)" in markdown
    assert markdown.count(" | leave-one-out | ") == sum(t.step == "leave-one-out" for t in result.trials)
    html = report.to_html()
    assert "Accuracy-budget search" in html and html.count("<td>") >= 7 * len(result.trials)


def test_a_plain_model_has_no_search_section(searched: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    model, _ = searched
    data = mlp_data()
    plain = fxquant.quantize(model, (data[0],), data, progress=False)
    report = _report(plain, model)
    assert report.budget_search is None and "budget_search" not in report.to_dict()
    assert "Accuracy-budget search" not in report.to_markdown()


def test_recorded_trials_come_from_the_converted_stage_only(searched: tuple[torch.nn.Module, torch.nn.Module]
                                                           ) -> None:
    section = searched[1].meta[FALLBACK_KEY].section("loss")
    entry = {"stage": "converted", "budget_search": json.loads(json.dumps(section.to_dict()))}
    assert recorded_trials([entry]) == section
    assert recorded_trials([entry, {"stage": "calibrated"}]) is None  # a later stage made the trials stale
    assert recorded_trials([{"stage": "converted"}]) is None  # a plain convert


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.pop("trials"), "missing key 'trials'"),
    (lambda d: d.update(chosen=99), "is not the index of one of its"),
    (lambda d: d["trials"][0].update(layers=[1]), r"trials\[0\].layers: expected a list of layer names"),
])
def test_a_malformed_section_raises_artifact_error(searched: tuple[torch.nn.Module, torch.nn.Module],
                                                   change: object, message: str) -> None:
    data = searched[1].meta[FALLBACK_KEY].section().to_dict()
    change(data)  # type: ignore[operator]
    with pytest.raises(ArtifactError, match=message):
        BudgetTrials.from_dict(data)

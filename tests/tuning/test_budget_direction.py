"""The accuracy-budget search with a lower-is-better metric, a relative budget, a scheme fallback, and bad options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from budget_testing import LAYERS, MLP, mlp_data, runs_as, synthetic_loss

import fxquant
from fxquant.errors import ConfigError
from fxquant.state import quant_state
from fxquant.tuning.budget import FALLBACK_KEY, FallbackResult, quantize_within_budget

COSTS = {"fc1": 0.010, "fc2": 0.001, "fc3": 0.008, "fc4": 0.001}


def _search(model: torch.nn.Module | None = None, **options: object) -> tuple[torch.nn.Module, FallbackResult]:
    data = mlp_data()
    qmodel = fxquant.quantize(model or MLP().eval(), (data[0],), data, max_trials=12, progress=False,
                              **options)  # type: ignore[arg-type]
    return qmodel, qmodel.meta[FALLBACK_KEY]


def test_a_lower_is_better_metric_keeps_the_layers_that_raise_it_float() -> None:
    qmodel, result = _search(eval_fn=synthetic_loss(COSTS), higher_is_better=False, max_accuracy_drop=0.005)
    table = result.to_markdown()
    assert result.trials[0].drop == pytest.approx(sum(COSTS.values())), table  # a rise is a drop of the loss
    assert result.met_budget and result.float_layers == ("fc1", "fc3"), table
    assert [runs_as(qmodel, p) == "Linear" for p in LAYERS] == [True, False, True, False]
    assert "| increase |" in table and "lower is better" in table, table


def test_the_direction_decides_what_meets_the_budget() -> None:
    """The same loss read as higher-is-better: all-INT8 'improves' it, so nothing is kept float."""
    _, result = _search(eval_fn=synthetic_loss(COSTS), max_accuracy_drop=0.005)
    assert result.trials[0].drop < 0 and result.float_layers == () and len(result.trials) == 1


def test_a_relative_budget_is_a_percentage_of_the_float_metric() -> None:
    eval_fn = synthetic_loss(COSTS, base=2.0)  # 0.25% of 2.0 is the 0.005 of the absolute test
    _, result = _search(eval_fn=eval_fn, higher_is_better=False, max_relative_drop=0.25)
    assert result.max_accuracy_drop == pytest.approx(0.005) and result.max_relative_drop == 0.25
    assert result.met_budget and result.float_layers == ("fc1", "fc3"), result.to_markdown()
    assert "(0.25% of the float metric)" in result.to_markdown()


def test_a_scheme_fallback_runs_the_chosen_layers_on_that_scheme_and_round_trips(tmp_path: Path) -> None:
    model = MLP().eval()
    qmodel, result = _search(model, eval_fn=synthetic_loss(COSTS), higher_is_better=False, max_accuracy_drop=0.005,
                             fallback="weight_only")
    assert result.met_budget and result.fallback_layers == ("fc1", "fc3"), result.to_markdown()
    assert result.float_layers == () and result.config.exclude == ()  # nothing float, nothing re-prepared
    assert [runs_as(qmodel, p) for p in LAYERS] == ["WeightOnlyInt8Linear", "QuantizedLinear",
                                                    "WeightOnlyInt8Linear", "QuantizedLinear"]
    assert quant_state(qmodel).schemes == {"fc1": "weight_only", "fc3": "weight_only"}
    assert "| layers on weight_only |" in result.to_markdown()
    fxquant.save(qmodel, tmp_path / "model")
    loaded = fxquant.load(tmp_path / "model", model)
    x = torch.randn(32, 8)
    assert torch.equal(loaded(x), qmodel(x))
    assert [runs_as(loaded, p) for p in LAYERS] == [runs_as(qmodel, p) for p in LAYERS]


def test_a_float_fallback_with_a_lower_is_better_metric_round_trips(tmp_path: Path) -> None:
    model = MLP().eval()
    qmodel, result = _search(model, eval_fn=synthetic_loss(COSTS), higher_is_better=False, max_accuracy_drop=0.005)
    assert set(result.config.exclude) == {"fc1", "fc3"}
    fxquant.save(qmodel, tmp_path / "model")
    x = torch.randn(32, 8)
    assert torch.equal(fxquant.load(tmp_path / "model", model)(x), qmodel(x))


@pytest.mark.parametrize(("options", "message"), [
    ({"fallback": "static"}, "fallback='static'"),
    ({"fallback": "int4"}, "unknown fallback 'int4'; use one of float, dynamic, dynamic_group, weight_only"),
    ({"granularity": "block"}, "unknown granularity 'block'"),
    ({"schemes": {"*": "static"}},
     "schemes must map module path patterns to one of dynamic, dynamic_group, weight_only"),
    ({"max_relative_drop": 1.0}, "give one budget"),
    ({"max_accuracy_drop": None, "max_relative_drop": -1}, "max_relative_drop must be a number >= 0"),
])
def test_bad_search_options_raise_one_config_error(options: dict[str, object], message: str) -> None:
    data = mlp_data()
    kwargs: dict[str, object] = {"max_accuracy_drop": 0.005, **options}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quantize_within_budget(MLP().eval(), (data[0],), data, eval_fn=lambda m: 1.0, progress=False,
                               **kwargs)  # type: ignore[arg-type]


def test_search_options_without_a_budget_are_refused() -> None:
    data = mlp_data()
    with pytest.raises(ConfigError, match="fallback only serve the accuracy-budget search"):
        fxquant.quantize(MLP().eval(), (data[0],), data, fallback="weight_only", progress=False)


def test_schemes_without_a_budget_convert_with_them() -> None:
    data = mlp_data()
    qmodel = fxquant.quantize(MLP().eval(), (data[0],), data, schemes={"fc4": "dynamic"}, progress=False)
    assert [runs_as(qmodel, p) for p in LAYERS] == ["QuantizedLinear"] * 3 + ["DynamicInt8Linear"]

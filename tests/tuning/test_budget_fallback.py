"""Keeping layers float at convert time, and the accuracy-budget search (synthetic metric and the real digits CNN)."""

from __future__ import annotations

import pytest
import torch
from budget_testing import LAYERS, MLP, mlp_data
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.errors import ConfigError
from fxquant.models import accuracy, digits_loader
from fxquant.models.digits import trained_digits_cnn
from fxquant.tuning.budget import FALLBACK_KEY, FallbackResult

DATA = mlp_data()


def _is_int8(model: nn.Module, path: str) -> bool:
    return type(model.get_submodule(path)).__name__.startswith("Quantized")


def test_keep_float_equals_excluding_at_prepare() -> None:
    model = MLP().eval()
    prepared = fxquant.prepare(model, (DATA[0],))
    fxquant.calibrate(prepared, DATA, progress=False)
    kept = fxquant.convert(prepared, keep_float=["fc2"])
    assert [_is_int8(kept, p) for p in LAYERS] == [True, False, True, True]
    excluded = fxquant.prepare(model, (DATA[0],), QuantConfig(exclude=["fc2"]))
    fxquant.calibrate(excluded, DATA, progress=False)
    x = torch.randn(32, 8)
    torch.testing.assert_close(kept(x), fxquant.convert(excluded, keep_float=["fc2"])(x))
    all_float = fxquant.convert(prepared, keep_float=["fc*"])
    torch.testing.assert_close(all_float(x), model(x))  # no quantize left anywhere


def test_exclude_at_prepare_keeps_the_layer_float() -> None:
    """Regression: the next layer's input observer directly after an excluded layer made it look observed."""
    qmodel = fxquant.quantize(MLP().eval(), (DATA[0],), DATA, QuantConfig(exclude=["fc2"]), progress=False)
    assert not _is_int8(qmodel, "fc2")


def _synthetic_metric(costs: dict[str, float]) -> object:
    """1.0 minus the cost of every layer that runs INT8: a metric whose answer is known."""
    return lambda model: 1.0 - sum(cost for path, cost in costs.items() if _is_int8(model, path))


def test_search_keeps_the_fewest_layers_float() -> None:
    eval_fn = _synthetic_metric({"fc1": 0.010, "fc2": 0.001, "fc3": 0.008, "fc4": 0.001})
    qmodel = fxquant.quantize(MLP().eval(), (DATA[0],), DATA, eval_fn=eval_fn, max_accuracy_drop=0.005,
                              max_trials=12, progress=False)
    result = qmodel.meta[FALLBACK_KEY]
    assert isinstance(result, FallbackResult)
    table = result.to_markdown()
    assert result.met_budget and result.float_layers == ("fc1", "fc3"), table
    assert [_is_int8(qmodel, p) for p in LAYERS] == [False, True, False, True]
    assert set(result.config.exclude) == {"fc1", "fc3"}  # the returned model was re-quantized with them excluded
    steps = [trial.step for trial in result.trials]
    assert steps[0] == "all INT8" and steps.count("leave-one-out") == 4 and "greedy" in steps, table
    assert steps[-1].startswith("final") and result.chosen == len(result.trials) - 1, table
    assert all(trial.latency_ms > 0 for trial in result.trials)


def test_unreachable_budget_returns_the_closest_model_within_the_trial_budget() -> None:
    eval_fn = _synthetic_metric({path: 0.1 for path in LAYERS})
    qmodel = fxquant.quantize(MLP().eval(), (DATA[0],), DATA, eval_fn=eval_fn, max_accuracy_drop=0.0,
                              max_trials=3, progress=False)
    result = qmodel.meta[FALLBACK_KEY]
    assert not result.met_budget and len(result.trials) <= 4, result.to_markdown()
    assert "NOT met" in result.to_markdown()
    assert result.best.metric == max(trial.metric for trial in result.trials)


def test_search_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="both eval_fn"):
        fxquant.quantize(MLP().eval(), (DATA[0],), DATA, eval_fn=lambda m: 1.0, progress=False)
    with pytest.raises(ConfigError, match="max_accuracy_drop"):
        fxquant.quantize(MLP().eval(), (DATA[0],), DATA, eval_fn=lambda m: 1.0, max_accuracy_drop=-1,
                         progress=False)


def test_digits_outlier_heavy_layer_is_found() -> None:
    """The real-data case: conv2's weights made outlier-heavy (same float function), per-tensor weights."""
    model = trained_digits_cnn()  # trained once per process
    with torch.no_grad():
        model.bn1.weight[0] /= 100
        model.bn1.bias[0] /= 100
        model.conv2.weight[:, 0] *= 100
    test = digits_loader("test")
    qmodel = fxquant.quantize(model, (torch.rand(1, 1, 8, 8),), digits_loader("calib"),
                              QuantConfig(weight="per_tensor", bias_correction=False),  # on, it halves the drop
                              eval_fn=lambda m: accuracy(m, test),
                              max_accuracy_drop=0.005, max_trials=4, progress=False)
    result = qmodel.meta[FALLBACK_KEY]
    table = result.to_markdown()
    assert result.trials[0].drop > 0.05, table  # plain INT8 misses the budget by far
    assert next(iter(result.sensitivity)) == "conv2", result.sensitivity
    assert result.met_budget and result.float_layers == ("conv2",), table

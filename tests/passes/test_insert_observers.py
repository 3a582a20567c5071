"""insert_observers (through prepare): where observers go, and that the prepared model computes the float one."""

from __future__ import annotations

import torch
from torch import nn

import fxquant
from fxquant.models import create_model
from fxquant.observers import Observer


def _observer_labels(gm: torch.fx.GraphModule) -> list[str]:
    modules = dict(gm.named_modules())
    observers = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], Observer)]
    return [modules[n.target].label for n in observers if modules[n.target].kind == "activation"]  # no statistics


def test_one_input_observer_and_one_per_layer_output() -> None:
    model = create_model("conv_bn")  # conv-bn-relu, maxpool, flatten, linear
    x = torch.randn(2, 3, 32, 32)
    prepared = fxquant.prepare(model, (x,))
    labels = _observer_labels(prepared)
    layers = [name for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert labels == [f"input_1 (input of {layers[0]})"] + [f"output of {name}" for name in layers], labels
    torch.testing.assert_close(prepared(x), model(x), rtol=1e-5, atol=1e-5)


def test_residual_adds_are_observed_and_float_values_observed_once() -> None:
    model = create_model("resnet18", num_classes=10)
    x = torch.randn(1, 3, 64, 64)
    prepared = fxquant.prepare(model, (x,))
    labels = _observer_labels(prepared)
    convs = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    adds = 8  # one residual add per BasicBlock, fused with the ReLU after it
    assert len(labels) == 1 + convs + adds
    assert sum("add_relu" in label for label in labels) == adds
    torch.testing.assert_close(prepared(x), model(x), rtol=1e-4, atol=1e-4)


def test_excluded_layer_gets_no_observer_and_float_input_is_observed_for_next() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4)).eval()
    prepared = fxquant.prepare(model, (torch.randn(2, 8),), fxquant.QuantConfig(exclude=["2"]))
    labels = _observer_labels(prepared)
    # the float output of layer 2 re-enters int8 through its own observer
    assert labels == ["input_1 (input of 0)", "output of 0", "2 (input of 3)", "output of 3"], labels


def test_prepare_leaves_the_users_model_untouched() -> None:
    model = create_model("conv_bn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = [type(m) for m in model.modules()]
    fxquant.prepare(model, (torch.randn(1, 3, 32, 32),))
    assert [type(m) for m in model.modules()] == modules_before
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key

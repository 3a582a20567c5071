"""Contract tests for the model zoo: every model runs, has the documented shapes, and traces (or refuses to) as
the pipeline and benchmarks expect. The digits example must really learn, quickly and reproducibly."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxquant.errors import ConfigError
from fxquant.models import (
    INPUT_SHAPES,
    UNTRACEABLE,
    ZOO,
    accuracy,
    create_model,
    digits_loader,
    example_inputs,
    load_digits_splits,
    mlp_net,
    train_digits_cnn,
)
from fxquant.models.control_flow import DataDependentBlock

BATCH = 2
# Per-sample output shape of each model with its default options.
OUTPUT_SHAPES = {
    "mlp": (1024,),
    "conv_bn": (10,),
    "resnet18": (1000,),
    "mobilenetv2": (1000,),
    "digits_cnn": (10,),
    "bert_style": (128, 256),
    "efficientnet": (1000,),
    "audio1d": (35,),
    "conv3d": (10,),
    "unet": (2, 64, 64),
    "control_flow": (10,),
}
TRACEABLE = sorted(set(ZOO) - UNTRACEABLE)


@functools.cache
def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return create_model(name)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (actual - expected).abs().max().item() if actual.shape == expected.shape else float("nan")
    assert torch.equal(actual, expected), f"traced output differs from eager: max abs diff {diff}"


def test_every_zoo_model_has_an_expected_output_shape() -> None:
    assert set(OUTPUT_SHAPES) == set(ZOO) == set(INPUT_SHAPES)
    assert {"mlp", "conv_bn", "resnet18", "mobilenetv2", "digits_cnn"} <= set(ZOO)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_forward_on_example_inputs(name: str) -> None:
    model, inputs = _model(name), example_inputs(name, BATCH)
    assert not model.training, "zoo factories return eval-mode models"
    assert [tuple(x.shape[1:]) for x in inputs] == list(INPUT_SHAPES[name])
    with torch.no_grad():
        out = model(*inputs)
    assert out.shape == (BATCH, *OUTPUT_SHAPES[name])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", TRACEABLE)
def test_symbolic_trace_matches_eager(name: str) -> None:
    model, inputs = _model(name), example_inputs(name, BATCH)
    traced = fx.symbolic_trace(model)
    with torch.no_grad():
        _assert_same(traced(*inputs), model(*inputs))


def test_control_flow_model_fails_whole_model_trace() -> None:
    with pytest.raises(fx.proxy.TraceError, match="control flow"):
        fx.symbolic_trace(_model("control_flow"))


def test_control_flow_model_traces_with_the_block_as_a_leaf() -> None:
    # Only DataDependentBlock is untraceable: the rest must be plain, quantizable graph.
    class LeafTracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, DataDependentBlock) or super().is_leaf_module(m, qualname)

    model, inputs = _model("control_flow"), example_inputs("control_flow", BATCH)
    traced = fx.GraphModule(model, LeafTracer().trace(model))
    with torch.no_grad():
        _assert_same(traced(*inputs), model(*inputs))


def test_bert_traced_graph_accepts_shorter_sequences() -> None:
    model = _model("bert_style")
    ids = example_inputs("bert_style", BATCH)[0][:, :16]
    with torch.no_grad():
        _assert_same(fx.symbolic_trace(model)(ids), model(ids))
    assert ids.dtype == torch.int64


@pytest.mark.parametrize(
    ("name", "expected"), [("resnet18", 11_689_512), ("mobilenetv2", 3_504_872), ("efficientnet", 5_288_548)]
)
def test_parameter_counts_match_the_reference_architectures(name: str, expected: int) -> None:
    assert sum(p.numel() for p in _model(name).parameters()) == expected


def test_factory_options_and_validation() -> None:
    assert sum(isinstance(m, nn.Linear) for m in mlp_net(hidden=8, layers=5).modules()) == 5
    assert create_model("resnet18", num_classes=7)(*example_inputs("resnet18")).shape == (1, 7)
    with pytest.raises(ConfigError, match="layers"):
        mlp_net(layers=0)
    with pytest.raises(ConfigError, match="divisible"):
        create_model("bert_style", hidden=30, heads=4)


def test_unknown_model_name_suggests_and_lists_known() -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'resnet18'.*mobilenetv2"):
        create_model("resnet19")


def test_example_inputs_are_seeded_and_leave_global_rng_alone() -> None:
    state = torch.get_rng_state()
    first, second = example_inputs("conv_bn", BATCH), example_inputs("conv_bn", BATCH)
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[0], example_inputs("conv_bn", BATCH, seed=1)[0])
    assert torch.equal(state, torch.get_rng_state())


def test_digits_splits_are_stratified_scaled_and_disjoint() -> None:
    splits = load_digits_splits()
    assert {name: len(y) for name, (_, y) in splits.items()} == {"train": 1257, "calib": 180, "test": 360}
    for images, labels in splits.values():
        assert images.dtype == torch.float32 and images.shape[1:] == (1, 8, 8)
        assert images.min() >= 0.0 and images.max() <= 1.0
        assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    with pytest.raises(ConfigError, match="calib"):
        digits_loader("validation")


def test_digits_cnn_trains_to_95_percent() -> None:
    start = time.perf_counter()
    model = train_digits_cnn(seed=0)
    elapsed = time.perf_counter() - start
    acc = accuracy(model, digits_loader("test", batch_size=128))
    print(f"digits CNN: test accuracy {acc:.2%}, trained in {elapsed:.2f} s")
    assert not model.training
    assert acc >= 0.95, f"test accuracy {acc:.2%} < 95% (trained in {elapsed:.2f} s)"


def test_digits_training_is_deterministic_and_keeps_global_rng() -> None:
    state = torch.get_rng_state()
    first, second = train_digits_cnn(epochs=1, seed=3), train_digits_cnn(epochs=1, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs between two runs with the same seed"


def test_accuracy_restores_the_training_mode() -> None:
    model = create_model("digits_cnn").train()
    accuracy(model, digits_loader("calib"))
    assert model.training

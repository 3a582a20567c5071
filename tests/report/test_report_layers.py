"""Per-layer capture: the float reference lines up with the converted graph, and a damaged layer ranks first."""

from __future__ import annotations

import pytest
import torch
from report_helpers import FAST, digits_model, digits_qmodel, digits_report, quantize_digits
from torch import fx, nn

import fxquant
from fxquant.errors import InputError
from fxquant.models.digits import digits_loader
from fxquant.nn.fused import Fused
from fxquant.nn.quantized import QuantizedConvNd
from fxquant.report.layers import CaptureInterpreter, float_reference, layer_paths


def test_float_reference_folds_and_fuses_like_the_converted_model() -> None:
    model = digits_model()
    reference = float_reference(model, ())
    assert isinstance(reference.get_submodule("conv1"), Fused)  # conv + bn + relu in one module, as in int8
    x = torch.rand(4, 1, 8, 8)
    capture = CaptureInterpreter(reference, layer_paths(model))
    out = capture.run(x)
    with torch.no_grad():
        expected = model.relu1(model.bn1(model.conv1(x)))
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(capture.captured["conv1"][1], expected, rtol=1e-4, atol=1e-5)
    assert set(capture.captured) == {"conv1", "conv2", "fc1", "fc2"}


def test_every_layer_is_listed_with_its_backend_ranges_and_reason() -> None:
    layers = {layer.name: layer for layer in digits_report().layers}
    assert [layers[n].quantized for n in ("conv1", "conv2", "fc1", "fc2")] == [True, True, True, False]
    assert layers["fc2"].reason == "excluded by config" and layers["fc2"].backend == "float"
    for name in ("conv1", "conv2", "fc1"):
        layer = layers[name]
        # Only a reference with BN folded at the same path gives outputs this close to the int8 ones.
        assert layer.sqnr_db is not None and layer.sqnr_db > 25, f"{name}: SQNR {layer.sqnr_db} dB"
        assert layer.backend == fxquant.QuantConfig().backend and layer.kind in ("Conv2d", "Linear")
        assert layer.weight_range is not None and layer.weight_range[0] < 0 < layer.weight_range[1]
        assert layer.activation_range is not None and layer.activation_range[0] >= 0  # fused ReLU
        assert layer.weight_histogram is not None and sum(layer.weight_histogram.counts) > 0
        assert layer.quant_range is not None and layer.weight_sqnr_db is not None
    assert [layer.name for layer in digits_report().ranking()] == sorted(
        ["conv1", "conv2", "fc1"], key=lambda n: layers[n].isolated_sqnr_db or 0.0)


def _damage(qmodel: fx.GraphModule, path: str) -> None:
    """Replace a quantized conv's int8 weights with noise (and re-pack them for the backend)."""
    module = qmodel.get_submodule(path)
    assert isinstance(module, QuantizedConvNd)
    generator = torch.Generator().manual_seed(0)
    module.weight.copy_(torch.randint(-127, 128, module.weight.shape, generator=generator, dtype=torch.int8))
    module.relower(module.backend)


def test_a_damaged_layer_ranks_first() -> None:
    qmodel = quantize_digits(exclude=["fc2"])
    _damage(qmodel, "conv2")  # a middle layer: later layers inherit its error, the isolated SQNR must not
    report = fxquant.report(digits_model(), qmodel, digits_loader("test", batch_size=64), max_batches=2, **FAST)
    ranking = [layer.name for layer in report.ranking()]
    damaged = {layer.name: layer for layer in report.layers}["conv2"]
    healthy = {layer.name: layer for layer in digits_report().layers}["conv2"]
    assert ranking[0] == "conv2", f"ranking {ranking}: {[(x.name, x.isolated_sqnr_db) for x in report.ranking()]}"
    assert damaged.isolated_sqnr_db is not None and healthy.isolated_sqnr_db is not None
    assert damaged.isolated_sqnr_db < healthy.isolated_sqnr_db - 20, (
        f"damaged conv2: {damaged.isolated_sqnr_db:.1f} dB, healthy: {healthy.isolated_sqnr_db:.1f} dB")
    assert report.to_dict()["sensitivity_ranking"][0] == "conv2"


def test_report_rejects_models_it_cannot_compare() -> None:
    data = digits_loader("test", batch_size=64)
    with pytest.raises(InputError, match="not produced by fxquant"):
        fxquant.report(digits_model(), fx.symbolic_trace(digits_model()), data, **FAST)
    prepared = fxquant.prepare(digits_model(), (torch.rand(1, 1, 8, 8),))
    with pytest.raises(InputError, match="convert"):
        fxquant.report(digits_model(), prepared, data, **FAST)
    with pytest.raises(InputError, match="needs targets"):
        fxquant.report(digits_model(), digits_qmodel(), [torch.rand(2, 1, 8, 8)], **FAST)
    with pytest.raises(fxquant.errors.ConfigError, match="batch_sizes"):
        fxquant.report(digits_model(), digits_qmodel(), data, batch_sizes=[0], **FAST)


def test_the_top_level_name_is_the_function_and_the_modules_still_import() -> None:
    from fxquant.report.latency import measure_latency
    from fxquant.report.size import serialized_size

    assert callable(fxquant.report) and fxquant.report.__name__ == "fxquant.report"  # the package, callable
    assert callable(measure_latency) and callable(serialized_size)
    assert fxquant.assert_no_regression.__module__ == "fxquant.report.regress"


def test_layers_inside_float_leaf_modules_say_so() -> None:
    from fxquant.models import create_model, example_inputs

    model = create_model("control_flow", channels=4)
    data = [example_inputs("control_flow", batch_size=2, seed=i) for i in range(2)]
    config = fxquant.QuantConfig(leaf_modules=["DataDependentBlock"], exclude=["fc"])
    qmodel = fxquant.quantize(model, data[0], data, config, progress=False)
    report = fxquant.report(model, qmodel, data, metric=lambda outputs: 0.0, **FAST)
    reasons = {layer.name: (layer.quantized, layer.reason) for layer in report.layers}
    assert reasons == {"stem": (True, ""), "gated.positive": (False, "inside leaf module 'gated' (runs as a float "
                                                                     "black box)"),
                       "gated.negative": (False, "inside leaf module 'gated' (runs as a float black box)"),
                       "fc": (False, "excluded by config")}
    assert {layer.name for layer in report.layers if layer.sqnr_db is None} == {"gated.positive", "gated.negative"}


class SamePadConv(nn.Conv2d):
    """A Conv2d subclass with its own forward: traced into, its F.conv2d call becomes a module at its path again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(nn.functional.pad(x, (1, 1, 1, 1)), self.weight, self.bias)


def test_layers_rebuilt_from_functional_calls_are_measured() -> None:
    model = nn.Sequential(SamePadConv(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(256, 2)).eval()
    data = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    qmodel = fxquant.quantize(model, (data[0],), data, progress=False)
    report = fxquant.report(model, qmodel, data, metric=lambda outputs: 0.0, **FAST)
    assert [(layer.name, layer.kind, layer.quantized) for layer in report.layers] == [
        ("0", "Conv2d", True), ("3", "Linear", True)]
    assert all(layer.sqnr_db is not None and layer.sqnr_db > 25 for layer in report.layers), report.to_markdown()


def test_latency_rounds_give_every_callable_every_predecessor() -> None:
    """A fixed (or rotated) order hands the same predecessor to a callable every round, and with it the cost of
    what that predecessor leaves behind; the order must change across rounds."""
    from fxquant.report.latency import measure_latency

    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    measure_latency(fns, warmup=0, min_runs=40, max_runs=40, time_budget_s=60)
    predecessors = {name: {calls[i - 1] for i in range(1, len(calls)) if calls[i] == name} for name in fns}
    assert all(previous == set(fns) - {name} or previous == set(fns) for name, previous in predecessors.items())
    assert sorted(calls) == sorted(list(fns) * 40)

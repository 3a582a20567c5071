"""lower_to_int8 (through convert): int8 regions, quantize/dequantize placement, module swaps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.kernels.registry import get_backend
from fxquant.models import create_model
from fxquant.nn import DeQuantize, Quantize, QuantizedAdd, QuantizedConv2d, QuantizedLinear
from fxquant.observers import Observer
from fxquant.testing import calibrated, quantized_dtype_backends


def _count(gm: torch.fx.GraphModule, *types: type) -> int:
    modules = dict(gm.named_modules())
    return sum(1 for n in gm.graph.nodes if n.op == "call_module" and isinstance(modules[n.target], types))


@pytest.mark.parametrize("backend", quantized_dtype_backends())
def test_chain_has_one_quantize_and_one_dequantize(backend: str) -> None:
    model = create_model("conv_bn")  # conv-relu -> maxpool -> flatten -> linear: one int8 region
    converted = fxquant.convert(calibrated(model, (4, 3, 32, 32)), backend=backend)
    assert _count(converted, Quantize) == 1
    # the Linear's only reader is the model output: it returns float itself where the backend can (fbgemm)
    assert _count(converted, DeQuantize) == (0 if get_backend(backend).fuses_float_output else 1)
    assert _count(converted, Observer) == 0
    assert _count(converted, QuantizedConv2d) == 1 and _count(converted, QuantizedLinear) == 1
    assert not any(isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)) for m in converted.modules())
    text = str(converted.graph)
    assert "quantize_0" in text  # print(converted.graph) shows the boundaries


@pytest.mark.parametrize("backend", quantized_dtype_backends())  # onednn fuses the adds into the convs
def test_resnet_stays_int8_through_adds_pooling_and_flatten(backend: str) -> None:
    model = create_model("resnet18", num_classes=10)
    converted = fxquant.convert(calibrated(model, (1, 3, 64, 64), batches=2), backend=backend)
    float_fc = get_backend(backend).fuses_float_output  # the classifier returns float itself
    assert _count(converted, Quantize) == 1 and _count(converted, DeQuantize) == (0 if float_fc else 1)
    assert _count(converted, QuantizedAdd) == 8
    relu_fused = [m.relu for m in converted.modules() if isinstance(m, QuantizedAdd)]
    assert all(relu_fused)


def test_float_island_gets_dequantize_before_and_quantize_after() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).eval()  # no int8 LayerNorm
    converted = fxquant.convert(calibrated(model, (4, 8)))
    ops = [type(m).__name__ for n in converted.graph.nodes if n.op == "call_module"
           for m in [converted.get_submodule(n.target)]]
    if get_backend(fxquant.QuantConfig().backend).fuses_float_output:  # both Linears are read only by float code
        assert ops == ["Quantize", "QuantizedLinear", "LayerNorm", "Quantize", "QuantizedLinear"]
    else:
        assert ops == ["Quantize", "QuantizedLinear", "DeQuantize", "LayerNorm", "Quantize", "QuantizedLinear",
                       "DeQuantize"]


def test_excluded_layer_stays_float() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    converted = fxquant.convert(calibrated(model, (4, 8), fxquant.QuantConfig(exclude=["2"])))
    assert isinstance(converted.get_submodule("0"), QuantizedLinear)
    assert type(converted.get_submodule("2")) is nn.Linear


def test_convert_does_not_change_the_prepared_model() -> None:
    prepared = calibrated(create_model("conv_bn"), (2, 3, 32, 32))
    before, observers = str(prepared.graph), _count(prepared, Observer)
    fxquant.convert(prepared)
    assert str(prepared.graph) == before
    assert observers == 4 and _count(prepared, Observer) == observers  # 3 ranges, the Linear's bias statistics

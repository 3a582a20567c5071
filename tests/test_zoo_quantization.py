"""Every zoo model through the whole pipeline: prepared == float, INT8 SQNR floor, full coverage, few boundaries."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.models import create_model, example_inputs
from fxquant.testing import assert_sqnr, simulate

# name -> (factory options, batch, SQNR floor vs FP32 in dB, most quantize+dequantize nodes allowed)
# Random deep nets with depthwise stages are chaotic (see mobilenetv2_style), so they run shallow variants here;
# EfficientNet's SE gates (sigmoid, mul by a broadcast float gate) keep float islands, hence its higher boundary count.
ZOO = {
    "mlp": ({"in_features": 128, "hidden": 128, "out_features": 32}, 8, 25.0, 2),
    "conv_bn": ({}, 8, 25.0, 2),
    "digits_cnn": ({}, 16, 25.0, 2),
    "resnet18": ({"num_classes": 10, "residual_gamma": 0.25}, 4, 25.0, 2),
    "mobilenetv2": ({"num_classes": 10, "settings": ((1, 16, 1, 1), (6, 24, 2, 2))}, 4, 25.0, 2),
    "efficientnet": ({"num_classes": 10, "width_mult": 0.5, "depth_mult": 0.3}, 2, 15.0, 80),
    "bert_style": ({"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128, "seq_len": 32}, 4, 25.0, 24),
    "audio1d": ({}, 4, 25.0, 2),
    "conv3d": ({}, 2, 25.0, 2),
    "unet": ({}, 2, 25.0, 2),
    "control_flow": ({}, 4, 25.0, 6),
}
SMALL_INPUTS = {"mlp": (128,), "resnet18": (3, 64, 64), "mobilenetv2": (3, 64, 64), "efficientnet": (3, 64, 64)}


def _batches(name: str, batch: int, count: int = 7) -> list[tuple[torch.Tensor, ...]]:
    if name == "bert_style":
        return [tuple(t[:, :32] for t in example_inputs(name, batch, seed=i)) for i in range(count)]
    shape = SMALL_INPUTS.get(name) or example_inputs(name, 1)[0].shape[1:]
    return [(torch.randn(batch, *shape),) for _ in range(count)]


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_end_to_end(name: str) -> None:
    options, batch, floor, max_boundaries = ZOO[name]
    model = create_model(name, **options)
    data = _batches(name, batch)
    config = fxquant.QuantConfig(exclude=["gated.negative"])  # control_flow: a branch calibration never reaches
    prepared = fxquant.prepare(model, data[0], config)
    with torch.inference_mode():
        torch.testing.assert_close(prepared(*data[0]), model(*data[0]), rtol=1e-4, atol=1e-4)
    fxquant.calibrate(prepared, data[1:], progress=False)
    qmodel = fxquant.convert(prepared)
    fresh = _batches(name, batch, count=1)[0]
    with torch.inference_mode():
        assert_sqnr(model(*fresh), qmodel(*fresh), floor, f"{name} INT8 vs FP32")
    report = fxquant.coverage(qmodel)
    layers = {p for p, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))}
    assert {r.path for r in report.layers} == layers, str(report)
    assert all(r.quantized for r in report.layers if r.path != "gated.negative"), str(report)
    boundaries = report.quantize_nodes + report.dequantize_nodes
    assert boundaries <= max_boundaries, f"{name}: {boundaries} quantize/dequantize nodes\n{report}"
    if name not in ("control_flow",):  # the simulation models the main graph only
        with torch.inference_mode():
            assert_sqnr(simulate(prepared)(*fresh), qmodel(*fresh), 20.0, f"{name} INT8 vs its fake-quant model")

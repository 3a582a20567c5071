"""Every zoo model through the whole pipeline: prepared == float, INT8 SQNR floor, full coverage, few boundaries."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.models import create_model, example_inputs
from fxquant.testing import assert_sqnr, seven_bit_margin_db, simulate

# name -> (factory options, batch, SQNR floor vs FP32 in dB, most quantize+dequantize nodes allowed). Floors sit 3 dB
# under the lowest SQNR measured on the default backend (onednn) over seeds 0-2 with the minmax and histogram
# observers (AMD EPYC, AVX512-VNNI; _quantized() below with torch.manual_seed(0..2)), less the 6 dB that one bit fewer
# costs where activations have 7 bits (CPUs without VNNI). Random deep nets with depthwise stages are chaotic (see
# mobilenetv2_style), so they run shallow variants here; EfficientNet's SE gates (sigmoid, mul by a broadcast float
# gate) keep float islands, hence its higher boundary count.
ZOO = {
    "mlp": ({"in_features": 128, "hidden": 128, "out_features": 32}, 8, 26.0, 2),
    "conv_bn": ({}, 8, 37.0, 2),
    "digits_cnn": ({}, 16, 33.0, 2),
    "resnet18": ({"num_classes": 10, "residual_gamma": 0.25}, 4, 23.0, 2),
    "mobilenetv2": ({"num_classes": 10, "settings": ((1, 16, 1, 1), (6, 24, 2, 2))}, 4, 24.0, 2),
    "efficientnet": ({"num_classes": 10, "width_mult": 0.5, "depth_mult": 0.3}, 2, 19.0, 80),
    "bert_style": ({"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128, "seq_len": 32}, 4, 63.0, 24),
    "audio1d": ({}, 4, 42.0, 2),
    "conv3d": ({}, 2, 39.0, 2),
    "unet": ({}, 2, 53.0, 2),
    "control_flow": ({}, 4, 44.0, 6),
}
# The INT8 model against its fake-quant simulation on the default backend, 3 dB under the lowest measured (onednn
# adds the float bias after scaling, the simulation rounds it to int32 first: not bit-exact; control_flow: the
# simulation models the main graph only).
SIMULATION_FLOORS = {"mlp": 133.0, "conv_bn": 75.0, "digits_cnn": 138.0, "resnet18": 29.0, "mobilenetv2": 43.0,
                     "efficientnet": 26.0, "bert_style": 93.0, "audio1d": 136.0, "conv3d": 139.0, "unet": 70.0}
# fbgemm's model is its simulation bit for bit on these (measured on every seed and observer above)
FBGEMM_EXACT = ("mlp", "digits_cnn", "conv3d")
SMALL_INPUTS = {"mlp": (128,), "resnet18": (3, 64, 64), "mobilenetv2": (3, 64, 64), "efficientnet": (3, 64, 64)}


def _batches(name: str, batch: int, count: int = 7) -> list[tuple[torch.Tensor, ...]]:
    if name == "bert_style":
        return [tuple(t[:, :32] for t in example_inputs(name, batch, seed=i)) for i in range(count)]
    shape = SMALL_INPUTS.get(name) or example_inputs(name, 1)[0].shape[1:]
    return [(torch.randn(batch, *shape),) for _ in range(count)]


def _quantized(name: str, backend: str | None = None) -> tuple[torch.nn.Module, torch.fx.GraphModule,
                                                                 torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    """The float model, its prepared and INT8 models on ``backend`` (None: the default), and fresh inputs, seeded."""
    options, batch, _, _ = ZOO[name]
    torch.manual_seed(0)
    model = create_model(name, **options)
    data = _batches(name, batch)
    kwargs = {} if backend is None else {"backend": backend}
    config = fxquant.QuantConfig(**kwargs)  # control_flow: gated.negative never runs, so it stays float
    prepared = fxquant.prepare(model, data[0], config)
    with torch.inference_mode():
        torch.testing.assert_close(prepared(*data[0]), model(*data[0]), rtol=1e-4, atol=1e-4)
    fxquant.calibrate(prepared, data[1:], progress=False)
    return model, prepared, fxquant.convert(prepared), _batches(name, batch, count=1)[0]


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_end_to_end(name: str) -> None:
    model, prepared, qmodel, fresh = _quantized(name)
    margin = seven_bit_margin_db(fxquant.QuantConfig().backend)
    with torch.inference_mode():
        assert_sqnr(model(*fresh), qmodel(*fresh), ZOO[name][2] - margin, f"{name} INT8 vs FP32")
    report = fxquant.coverage(qmodel)
    layers = {p for p, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))}
    lookups = {p for p, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    assert {r.path for r in report.layers if not r.lookup} == layers, str(report)
    assert {r.path for r in report.layers if r.lookup} == lookups, str(report)
    assert all(r.quantized for r in report.layers if r.path != "gated.negative" and not r.lookup), str(report)
    assert report.int8_mac_fraction == 1.0, str(report)  # every multiply-add the example inputs run is INT8
    boundaries = report.quantize_nodes + report.dequantize_nodes
    assert boundaries <= ZOO[name][3], f"{name}: {boundaries} quantize/dequantize nodes\n{report}"
    if name in SIMULATION_FLOORS:  # one step of a 7-bit grid is two of an 8-bit one: the same margin
        with torch.inference_mode():
            assert_sqnr(simulate(prepared)(*fresh), qmodel(*fresh), SIMULATION_FLOORS[name] - margin,
                        f"{name} INT8 vs its fake-quant model")


@pytest.mark.skipif("fbgemm" not in available_backends(), reason="no fbgemm engine in this torch build")
@pytest.mark.parametrize("name", FBGEMM_EXACT)
def test_fbgemm_zoo_models_are_their_simulation_bit_for_bit(name: str) -> None:
    _, prepared, qmodel, fresh = _quantized(name, "fbgemm")
    with torch.inference_mode():
        assert torch.equal(simulate(prepared)(*fresh), qmodel(*fresh))

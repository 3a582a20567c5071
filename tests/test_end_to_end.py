"""Whole pipeline on models of the zoo on every deployment backend: INT8 output within 25 dB SQNR of FP32 (less the
7-bit margin where the CPU has no VNNI); digits accuracy within 1 point."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.models import create_model
from fxquant.models.digits import accuracy, digits_loader, train_digits_cnn
from fxquant.testing import assert_sqnr, quantized_dtype_backends, seven_bit_margin_db, simulate

# A MobileNetV2-style stack shallow enough not to be chaotic with random weights (see mobilenetv2_style).
SHALLOW_MOBILENET = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 1))
CASES = {
    "mlp": (lambda: create_model("mlp", hidden=256, in_features=256, out_features=64), (16, 256)),
    "conv_bn": (lambda: create_model("conv_bn"), (8, 3, 32, 32)),
    "resnet18": (lambda: create_model("resnet18", num_classes=100, residual_gamma=0.25), (4, 3, 64, 64)),
    "mobilenetv2": (lambda: create_model("mobilenetv2", num_classes=100, settings=SHALLOW_MOBILENET),
                    (8, 3, 64, 64)),
}
BACKENDS = [b for b in ("onednn",) if b in available_backends()] + quantized_dtype_backends()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_int8_output_within_25_db_of_fp32(name: str, backend: str) -> None:
    factory, shape = CASES[name]
    model = factory()
    data = [torch.randn(*shape) for _ in range(8)]
    prepared = fxquant.prepare(model, (data[0],), fxquant.QuantConfig(backend=backend))
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared)
    fresh = torch.randn(*shape)
    with torch.inference_mode():
        reference, actual = model(fresh), qmodel(fresh)
    assert_sqnr(reference, actual, 25.0 - seven_bit_margin_db(backend), f"{name} on {backend}")
    assert_sqnr(simulate(prepared, backend)(fresh), actual, 25.0, f"{name} on {backend} vs fake-quant simulation")


@pytest.fixture(scope="module")
def digits_model() -> torch.nn.Module:
    return train_digits_cnn()


@pytest.mark.parametrize("backend", BACKENDS)
def test_digits_int8_accuracy_within_one_point(backend: str, digits_model: torch.nn.Module) -> None:
    model = digits_model
    calib = digits_loader("calib", batch_size=64)
    prepared = fxquant.prepare(model, (next(iter(calib))[0],), fxquant.QuantConfig(backend=backend))
    summary = fxquant.calibrate(prepared, calib, progress=False)  # (image, label) batches: labels are dropped
    assert summary.samples == 180
    qmodel = fxquant.convert(prepared)
    test = digits_loader("test", batch_size=128)
    fp32, int8 = accuracy(model, test), accuracy(qmodel, test)
    assert fp32 >= 0.95, f"float model only reached {fp32:.2%}"
    assert int8 >= fp32 - 0.01, f"INT8 accuracy {int8:.2%} vs FP32 {fp32:.2%}"

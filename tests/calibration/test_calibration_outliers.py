"""On a model with planted activation outliers, the clipping observers beat minmax (SQNR of the INT8 output)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fxquant

OUTLIER_CHANNELS = (5, 40)
FACTOR = 100.0


def outlier_mlp() -> nn.Sequential:
    """Linear-ReLU-Linear whose hidden channels ``OUTLIER_CHANNELS`` are 100x larger than the others.

    Planted without changing the function: the channels' weights and biases are scaled up by ``FACTOR`` and the
    next layer's weights reading them scaled down (ReLU commutes with positive scaling), as outlier features arise
    in trained transformers.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        first, last = nn.Linear(32, 128), nn.Linear(128, 10)
    with torch.no_grad():
        for channel in OUTLIER_CHANNELS:
            first.weight[channel] *= FACTOR
            first.bias[channel] *= FACTOR
            last.weight[:, channel] /= FACTOR
    return nn.Sequential(first, nn.ReLU(), last).eval()


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    return 10 * math.log10(float(reference.pow(2).sum()) / float((reference - actual).pow(2).sum()))


@pytest.fixture(scope="module")
def sqnr_by_observer() -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    calibration = [torch.randn(64, 32, generator=generator) for _ in range(8)]
    test = torch.randn(512, 32, generator=generator)
    model = outlier_mlp()
    with torch.no_grad():
        reference = model(test)
    results = {}
    for name in ("minmax", "percentile", "entropy", "mse"):
        config = fxquant.QuantConfig(activation=name, backend="reference")
        prepared = fxquant.prepare(model, (calibration[0],), config)
        fxquant.calibrate(prepared, calibration, progress=False)
        with torch.no_grad():
            results[name] = sqnr_db(reference, fxquant.convert(prepared)(test))
    return results


@pytest.mark.parametrize("name", ["percentile", "entropy", "mse"])
def test_clipping_observers_beat_minmax_on_outliers(name: str, sqnr_by_observer: dict[str, float]) -> None:
    measured, baseline = sqnr_by_observer[name], sqnr_by_observer["minmax"]
    assert measured > baseline + 0.1, f"{name}: {measured:.2f} dB vs minmax {baseline:.2f} dB"


def test_outlier_channels_are_diagnosed() -> None:
    data = [torch.randn(64, 32) for _ in range(2)]
    summary = fxquant.calibrate(fxquant.prepare(outlier_mlp(), (data[0],)), data, progress=False)
    assert any({c for c, _ in s.outliers} == set(OUTLIER_CHANNELS) for s in summary.channel_spreads), summary

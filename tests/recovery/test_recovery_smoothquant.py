"""SmoothQuant: statistics, scales and folds against a reference computation; the explicit scale; SQNR gain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.api import apply_statistics
from fxquant.observers import MinMaxObserver
from fxquant.passes import ChannelRangeObserver, ChannelScale
from fxquant.qparams import sqnr_db
from fxquant.testing import simulate

ALPHA = 0.5


class NormToLinears(nn.Module):
    """A LayerNorm read only by two Linears (foldable), with two channels 80x larger."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q, self.k = nn.LayerNorm(16), nn.Linear(16, 8), nn.Linear(16, 8)
        with torch.no_grad():
            self.norm.weight[:2] *= 80
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.q(h) * self.k(h)


class NormWithResidual(NormToLinears):
    """The same norm also feeds a residual: 1/s cannot be folded into it, an explicit scale is inserted."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h + self.q(h)


class LinearToLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.fc1.weight[:3] *= 60
            self.fc1.bias[:3] *= 60

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _calibrated(model: nn.Module, data: list[torch.Tensor]) -> torch.fx.GraphModule:
    # bias correction off: these tests check SmoothQuant's own arithmetic on the outputs
    prepared = fxquant.prepare(model.eval(), (data[0],), QuantConfig(smoothquant_alpha=ALPHA, bias_correction=False))
    fxquant.calibrate(prepared, data, progress=False)
    return prepared


def _reference_scales(activation: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    act = activation.reshape(-1, activation.shape[-1]).abs().amax(dim=0)
    weight = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    return act.pow(ALPHA) / weight.pow(1 - ALPHA)


def test_fold_into_layernorm_matches_reference() -> None:
    model = NormToLinears().eval()
    data = [torch.randn(4, 6, 16) for _ in range(3)]
    prepared = _calibrated(model, data)
    with torch.no_grad():
        activation = torch.cat([model.norm(x).reshape(-1, 16) for x in data])
    statistics = [m for m in prepared.modules() if isinstance(m, ChannelRangeObserver)]
    assert len(statistics) == 1  # one per value, shared by q and k
    torch.testing.assert_close(statistics[0].channel_min, activation.amin(dim=0))
    torch.testing.assert_close(statistics[0].channel_max, activation.amax(dim=0))

    s = _reference_scales(activation, [model.q.weight.detach(), model.k.weight.detach()])
    smoothed = apply_statistics(prepared)
    torch.testing.assert_close(smoothed.get_submodule("q").weight, model.q.weight * s)
    torch.testing.assert_close(smoothed.get_submodule("k").weight, model.k.weight * s)
    torch.testing.assert_close(smoothed.get_submodule("norm").weight, model.norm.weight / s)
    torch.testing.assert_close(smoothed.get_submodule("norm").bias, model.norm.bias / s)
    assert not any(isinstance(m, (ChannelRangeObserver, ChannelScale)) for m in smoothed.modules())
    observer = next(m for m in smoothed.modules() if isinstance(m, MinMaxObserver))
    smoothed_activation = activation / s
    torch.testing.assert_close(observer.min_val, smoothed_activation.min())  # range recomputed exactly
    torch.testing.assert_close(observer.max_val, smoothed_activation.max())
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(smoothed(x), model(x), rtol=1e-4, atol=1e-4)  # same float function


def test_explicit_scale_where_the_value_has_other_readers() -> None:
    model = NormWithResidual().eval()
    data = [torch.randn(4, 6, 16) for _ in range(3)]
    prepared = _calibrated(model, data)
    with torch.no_grad():
        activation = torch.cat([model.norm(x).reshape(-1, 16) for x in data])
    s = _reference_scales(activation, [model.q.weight.detach()])
    qmodel = fxquant.convert(prepared)
    scales = [m for m in qmodel.modules() if isinstance(m, ChannelScale)]
    assert len(scales) == 1, qmodel.graph
    torch.testing.assert_close(scales[0].scale, 1 / s)
    x = torch.randn(2, 6, 16)
    smoothed = apply_statistics(prepared)
    torch.testing.assert_close(smoothed.get_submodule("norm").weight, model.norm.weight)  # not folded
    torch.testing.assert_close(smoothed(x), model(x), rtol=1e-4, atol=1e-4)
    measured = sqnr_db(simulate(smoothed)(x), qmodel(x))
    assert measured >= 35, f"INT8 vs its fake-quant twin: {measured:.2f} dB"


def test_fold_into_preceding_linear() -> None:
    model = LinearToLinear().eval()
    data = [torch.randn(16, 8) for _ in range(3)]
    prepared = _calibrated(model, data)
    with torch.no_grad():
        hidden = torch.cat([torch.relu(model.fc1(x)) for x in data])
    s = _reference_scales(hidden, [model.fc2.weight.detach()])
    s = torch.where(hidden.abs().amax(dim=0) > 0, s, torch.ones_like(s))  # dead ReLU channels keep s = 1
    s_in = _reference_scales(torch.cat(data), [model.fc1.weight.detach()])  # fc1's own input is smoothed too
    smoothed = apply_statistics(prepared)
    fc1 = smoothed.get_submodule("fc1").inner
    torch.testing.assert_close(fc1.weight, model.fc1.weight * s_in[None, :] / s[:, None])
    torch.testing.assert_close(fc1.bias, model.fc1.bias / s)
    torch.testing.assert_close(smoothed.get_submodule("fc2").weight, model.fc2.weight * s)
    x = torch.randn(8, 8)
    torch.testing.assert_close(smoothed(x), model(x), rtol=1e-4, atol=1e-4)


class PreNormBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` with 3 norm channels ``factor`` x larger, compensated in fc1: same float
    function."""

    def __init__(self, factor: float = 100.0) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        with torch.no_grad():
            self.norm.weight[:3] *= factor
            self.fc1.weight[:, :3] /= factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.mark.parametrize("factor", [50.0, 100.0])
def test_smoothquant_gain_on_planted_outliers(factor: float) -> None:
    torch.manual_seed(0)
    model = PreNormBlock(factor).eval()
    data = [torch.randn(8, 16, 32) for _ in range(4)]
    x = torch.randn(8, 16, 32)
    plain = fxquant.quantize(model, (x,), data, QuantConfig(), progress=False)
    smooth = fxquant.quantize(model, (x,), data, QuantConfig(smoothquant_alpha=0.5), progress=False)
    # the residual x dominates the output: measure the block's own contribution
    reference = model(x) - x
    before, after = sqnr_db(reference, plain(x) - x), sqnr_db(reference, smooth(x) - x)
    assert after - before >= 6.0, f"SmoothQuant at {factor:g}x: {before:.2f} -> {after:.2f} dB"


def test_statistics_survive_recompute_and_save_load(tmp_path: object) -> None:
    model = NormWithResidual().eval()
    data = [torch.randn(4, 6, 16) for _ in range(3)]
    prepared = fxquant.prepare(model, (data[0],), QuantConfig(activation="histogram", smoothquant_alpha=ALPHA,
                                                               bias_correction=True))
    fxquant.calibrate(prepared, data, progress=False)
    fxquant.recompute_qparams(prepared, activation="percentile")
    assert sum(isinstance(m, ChannelRangeObserver) for m in prepared.modules()) == 1
    qmodel = fxquant.convert(prepared)
    path = fxquant.save(qmodel, f"{tmp_path}/artifact")
    loaded = fxquant.load(path, model)
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(loaded(x), qmodel(x))

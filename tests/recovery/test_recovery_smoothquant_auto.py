"""``smoothquant_alpha="auto"``: per-group alpha against a fake-quant reference written here, the row sample, config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.artifacts.manifest import checksum
from fxquant.errors import ArtifactError, ConfigError
from fxquant.passes import ChannelRangeObserver, smoothing_choices, smoothquant_alphas
from fxquant.passes.smoothquant_auto import AUTO_ALPHAS, SAMPLE_ROWS
from fxquant.qparams import sqnr_db
from fxquant.state import quant_state

GRID: tuple[float | None, ...] = (None, *AUTO_ALPHAS)  # None: no smoothing


def _reference_error(calibration: torch.Tensor, new: torch.Tensor, weight: torch.Tensor,
                     alpha: float | None) -> float:
    """Relative output error of ``new @ weight.T`` when ``calibration`` sets the SmoothQuant scales and the uint8
    range of the smoothed input, and the weight is int8 per output channel: written from the formulas, not fxquant."""
    if alpha is None:
        s = torch.ones(weight.shape[1])
    else:
        s = calibration.abs().amax(0).pow(alpha) / weight.abs().amax(0).pow(1 - alpha)
    smoothed = calibration / s
    lo, hi = smoothed.min().clamp(max=0), smoothed.max().clamp(min=0)
    step = (hi - lo) / 255
    zero = torch.round(-lo / step)
    x_hat = (torch.clamp(torch.round(new / s / step) + zero, 0, 255) - zero) * step
    w = weight * s
    w_step = w.abs().amax(1, keepdim=True) / 127.5
    w_hat = torch.clamp(torch.round(w / w_step), -128, 127) * w_step
    y = new @ weight.T
    return float(((x_hat @ w_hat.T - y) ** 2).sum() / (y ** 2).sum())


def _two_fold(rows: torch.Tensor, weight: torch.Tensor, alpha: float | None) -> float:
    half = rows.shape[0] // 2
    a, b = rows[:half], rows[half:]
    return (_reference_error(a, b, weight, alpha) + _reference_error(b, a, weight, alpha)) / 2


def _data(factor: float, seed: int, batches: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gain = torch.ones(64)
    gain[:3] = factor  # planted outlier channels (1 = none)
    return [torch.randn(128, 64, generator=generator) * gain for _ in range(batches)]


def _auto_linear(factor: float, seed: int = 0) -> tuple[nn.Linear, torch.fx.GraphModule, list[torch.Tensor]]:
    torch.manual_seed(seed)
    linear = nn.Linear(64, 32).eval()
    calibration = _data(factor, seed, 16)  # 2048 rows, 8x the sample
    prepared = fxquant.prepare(nn.Sequential(linear).eval(), (calibration[0],), QuantConfig(smoothquant_alpha="auto"))
    fxquant.calibrate(prepared, calibration, progress=False)
    return linear, prepared, calibration


def test_auto_choice_is_the_argmin_of_a_reference_computation() -> None:
    linear, prepared, _ = _auto_linear(60.0)
    statistics = next(m for m in prepared.modules() if isinstance(m, ChannelRangeObserver))
    rows = statistics.samples()
    assert rows.shape[0] == SAMPLE_ROWS
    choice = smoothing_choices(fxquant.convert(prepared))["0"]
    reference = {alpha: _two_fold(rows, linear.weight.detach(), alpha) for alpha in GRID}
    for alpha, error in reference.items():
        assert choice.errors[alpha] == pytest.approx(error, rel=1e-3), f"alpha={alpha}"
        assert reference[choice.alpha] <= error * (1 + 1e-6), f"auto {choice.alpha}: {reference}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_on_planted_outliers_is_near_the_best_fixed_alpha_on_new_data(seed: int) -> None:
    linear, prepared, calibration = _auto_linear(60.0, seed)
    alpha = smoothquant_alphas(fxquant.convert(prepared))["0"]
    calib, new = torch.cat(calibration), torch.cat(_data(60.0, seed + 100, 8))
    errors = {a: _reference_error(calib, new, linear.weight.detach(), a) for a in GRID}
    best = min(errors.values())
    assert alpha is not None, errors
    assert errors[alpha] <= 1.6 * best, f"auto {alpha}: {errors[alpha]:.3g}, best fixed alpha {best:.3g}"
    assert errors[alpha] <= 0.2 * errors[None], f"auto {alpha}: {errors[alpha]:.3g}, unsmoothed {errors[None]:.3g}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_without_outliers_is_not_worse_than_no_smoothing(seed: int) -> None:
    linear, prepared, calibration = _auto_linear(1.0, seed)
    alpha = smoothquant_alphas(fxquant.convert(prepared))["0"]
    calib, new = torch.cat(calibration), torch.cat(_data(1.0, seed + 100, 8))
    auto = _reference_error(calib, new, linear.weight.detach(), alpha)
    plain = _reference_error(calib, new, linear.weight.detach(), None)
    assert auto <= 1.05 * plain, f"auto {alpha}: {auto:.3g}, unsmoothed {plain:.3g}"


class PreNormBlock(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` with 3 norm channels 100x larger, compensated in fc1."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 64), nn.Linear(64, 32)
        with torch.no_grad():
            self.norm.weight[:3] *= 100
            self.fc1.weight[:, :3] /= 100

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def test_auto_end_to_end_gain_recorded_and_survives_save_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = PreNormBlock().eval()
    data = [torch.randn(8, 16, 32) for _ in range(4)]
    x = torch.randn(8, 16, 32)
    plain = fxquant.quantize(model, (x,), data, QuantConfig(), progress=False)
    auto = fxquant.quantize(model, (x,), data, QuantConfig(smoothquant_alpha="auto"), progress=False)
    reference = model(x) - x  # the residual dominates the output: measure the block's own contribution
    before, after = sqnr_db(reference, plain(x) - x), sqnr_db(reference, auto(x) - x)
    assert after - before >= 6.0, f"SmoothQuant auto: {before:.2f} -> {after:.2f} dB"
    alphas = smoothquant_alphas(auto)
    assert set(alphas) == {"fc1", "fc2"} and alphas["fc1"] is not None, alphas
    loaded = fxquant.load(fxquant.save(auto, tmp_path / "artifact"), model)
    torch.testing.assert_close(loaded(x), auto(x))
    assert smoothquant_alphas(loaded) == alphas


def test_fixed_alpha_is_recorded_too() -> None:
    prepared = fxquant.prepare(nn.Sequential(nn.Linear(64, 32)).eval(), (torch.randn(4, 64),),
                               QuantConfig(smoothquant_alpha=0.5))
    fxquant.calibrate(prepared, [torch.randn(4, 64)], progress=False)
    statistics = next(m for m in prepared.modules() if isinstance(m, ChannelRangeObserver))
    assert statistics.sample_rows.numel() == 0  # a fixed alpha keeps no rows
    assert smoothquant_alphas(fxquant.convert(prepared)) == {"0": 0.5}


def test_row_sample_is_bounded_made_of_input_rows_and_merges() -> None:
    small, big = ChannelRangeObserver(8, samples=16), ChannelRangeObserver(8, samples=16)
    few = torch.randn(10, 8)
    small(few)
    torch.testing.assert_close(small.samples().sort(dim=0).values, few.sort(dim=0).values)  # all kept
    many = [torch.randn(3, 20, 8) for _ in range(4)]
    for batch in many:
        big(batch)
    rows = big.samples()
    assert rows.shape == (16, 8)
    pool = torch.cat([b.reshape(-1, 8) for b in many])
    assert all((pool == row).all(dim=1).any() for row in rows)  # every sampled row is an input row
    keys = torch.cat([small.sample_keys, big.sample_keys]).sort().values[:16]
    small.merge(big)
    assert small.samples().shape == (16, 8)
    torch.testing.assert_close(small.sample_keys, keys)  # the 16 smallest keys of both samples


def test_config_accepts_auto_and_rejects_other_values(tmp_path: Path) -> None:
    assert QuantConfig(smoothquant_alpha="auto").smoothquant_alpha == "auto"
    assert QuantConfig(smoothquant_alpha=0.7).smoothquant_alpha == 0.7
    for bad in ("Auto", "0.5", 1.5, -0.1, True, [0.5]):
        with pytest.raises(ConfigError, match=r"None \(off\), a number in \[0, 1\].*'auto'"):
            QuantConfig(smoothquant_alpha=bad)  # type: ignore[arg-type]
    files = {"c.json": json.dumps({"smoothquant_alpha": "auto"}), "c.yaml": "smoothquant_alpha: auto\n",
             "c.toml": 'smoothquant_alpha = "auto"\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert QuantConfig.from_file(tmp_path / name).smoothquant_alpha == "auto", name
    assert QuantConfig.from_dict(QuantConfig(smoothquant_alpha="auto").to_dict()).smoothquant_alpha == "auto"


def test_a_converted_model_keeps_the_choices_not_the_sampled_rows(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = PreNormBlock().eval()
    x = torch.randn(8, 16, 32)
    prepared = fxquant.prepare(model, (x,), QuantConfig(smoothquant_alpha="auto"))
    fxquant.calibrate(prepared, [torch.randn(8, 16, 32) for _ in range(4)], progress=False)
    assert sum(m.sample_rows.numel() for m in prepared.modules() if isinstance(m, ChannelRangeObserver)) > 0
    auto = fxquant.convert(prepared)
    state = quant_state(auto)
    samples = [v for k, v in state.observer_state.items() if k.endswith((".sample_rows", ".sample_keys"))]
    assert samples and all(v.numel() == 0 for v in samples)
    alphas = smoothquant_alphas(auto)
    assert state.smoothquant_alphas == alphas and alphas["fc1"] is not None
    path = fxquant.save(auto, tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["smoothquant_alphas"] == alphas
    loaded = fxquant.load(path, model)
    assert torch.equal(loaded(x), auto(x)) and smoothquant_alphas(loaded) == alphas
    again = fxquant.load(fxquant.save(loaded, tmp_path / "again"), model)  # a loaded model saves as it loaded
    assert torch.equal(again(x), auto(x))
    # the record is what convert replays: another alpha there rebuilds other weights, which the check refuses
    _rewrite(path, manifest, 0.1 if alphas["fc1"] != 0.1 else 0.9)
    with pytest.raises(ArtifactError, match="weights differ"):
        fxquant.load(path, model)
    _rewrite(path, manifest, "high")
    with pytest.raises(ArtifactError, match="smoothquant_alphas"):
        fxquant.load(path, model)


def _rewrite(path: Path, manifest: dict[str, Any], alpha: object) -> None:
    """The manifest with fc1's recorded alpha replaced, checksummed again (as a deliberate edit would be)."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    body["smoothquant_alphas"] = {**body["smoothquant_alphas"], "fc1": alpha}
    (path / "manifest.json").write_text(json.dumps({**body, "checksum": checksum(body)}))

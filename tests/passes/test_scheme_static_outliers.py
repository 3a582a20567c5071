"""``QuantConfig(scheme="static_outliers")``: static W8A8 whose input range is calibrated over the ordinary tokens,
a token outside it quantized with its own scale (:class:`~fxquant.nn.schemes.StaticOutliersInt8Linear`).

The kernel is checked against a re-computation written here from the layer's own buffers (uint8 rows on the
calibrated grid, the others symmetric per row, sums in float64); the calibration against the planted outlier rows
it must leave out; whole models against the float model, and against plain static W8A8 on data with an attention-
sink-like token (the case the scheme exists for); with SmoothQuant, against the scheme unsmoothed on data that also
has outlier channels.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import fxquant
from fxquant.config import QuantConfig
from fxquant.errors import CalibrationError, ConfigError
from fxquant.kernels.static_outliers import quantize_static_rows
from fxquant.models import mlp_net
from fxquant.nn.fused import Fused
from fxquant.nn.schemes import StaticOutliersInt8Linear
from fxquant.observers import MinMaxObserver
from fxquant.passes.smoothquant_auto import candidate_error, smoothquant_alphas
from fxquant.passes.token_ranges import OUTLIER_FACTOR, TokenRangeObserver
from fxquant.qparams import affine_qparams
from fxquant.state import graph_of

PATHS = ("0", "2", "4")
SINK = 200.0  # the planted outlier token's size, times an ordinary token's
# measured (seeds 0-2, 16 rows with one planted sink row, SQNR against float): static_outliers 39.8-40.7 dB on the
# ordinary rows and 36.8-39.0 dB on the sink row; plain static (minmax, so its range holds the sink) 1.4-1.6 dB on
# the ordinary rows. The floors sit a few dB under.
ORDINARY_FLOOR, SINK_FLOOR = 36.0, 33.0
STATIC_CEILING = 10.0
# measured (seeds 0-5, outlier channels 30x and 12x and a sink row, 8 calibration batches, minmax): ordinary rows
# 26.6-28.2 dB unsmoothed, 36.1-36.8 dB with smoothquant_alpha="auto"; its sink rows 37.3-39.6 dB
SMOOTHED_FLOOR, UNSMOOTHED_CEILING, SMOOTHED_SINK_FLOOR = 33.0, 30.5, 34.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp_net(in_features=64, hidden=96, out_features=40, layers=3)


def _rows(seed: int, count: int = 16, sink: bool = True) -> torch.Tensor:
    x = torch.randn(count, 64, generator=torch.Generator().manual_seed(seed))
    if sink:
        x[0] *= SINK  # the first token, as an attention sink is
    return x


def _channel_rows(seed: int) -> torch.Tensor:
    """:func:`_rows` with two outlier channels too, as a transformer's norm outputs have."""
    x = _rows(seed)
    x[:, 3] *= 30
    x[:, 17] *= 12
    return x


def _sqnr(reference: torch.Tensor, output: torch.Tensor) -> float:
    ref, out = reference.double(), output.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _layer(qmodel: nn.Module, path: str) -> nn.Module:
    module = graph_of(qmodel).get_submodule(path)
    return module.inner if isinstance(module, Fused) else module


def _recomputed(x: torch.Tensor, layer: StaticOutliersInt8Linear) -> torch.Tensor:
    """The layer from its buffers: a row within the calibrated uint8 range on that grid, any other row symmetric
    with max|x| / 127; sums in float64, scaled in float32."""
    scale, zero_point = layer.input_qparams.tolist()
    inside = (x.amin(dim=1) >= -zero_point * scale) & (x.amax(dim=1) <= (255 - zero_point) * scale)
    own = x.abs().amax(dim=1, keepdim=True).div(127.0).clamp(min=torch.finfo(torch.float32).tiny)
    static_levels = torch.div(x, torch.tensor(scale, dtype=torch.float32)).round().add(zero_point).clamp(0, 255) \
        - zero_point
    levels = torch.where(inside[:, None], static_levels, torch.div(x, own).round().clamp(-127, 127))
    row_scale = torch.where(inside[:, None], torch.tensor(scale, dtype=torch.float32), own)
    sums = (levels.double() @ layer.qweight.double().t()).to(torch.float32)
    out = sums * row_scale * layer.weight_scale
    return out if layer.bias is None else out + layer.bias


def _layer_with_range(lo: float, hi: float, seed: int = 0) -> StaticOutliersInt8Linear:
    linear = nn.Linear(64, 24)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(seed))
    observer = MinMaxObserver()
    observer.update(torch.tensor([lo, hi]))
    return StaticOutliersInt8Linear.from_observed(linear, "per_channel", observer)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_the_layer_is_its_recomputation_from_its_buffers(rows: int) -> None:
    layer = _layer_with_range(-3.0, 3.5)
    x = _rows(rows, rows, sink=False)
    x[rows // 2] *= 10  # one row outside the range: its own scale
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, _recomputed(x, layer), rtol=2e-6, atol=1e-5)


def test_rows_inside_the_range_use_it_and_the_others_their_own_scale() -> None:
    scale, zero_point = affine_qparams(torch.tensor(-3.0), torch.tensor(3.5)).scale, 128
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).clamp(-2.9, 2.9)
    x[2, 5] = 50.0
    x[4, 7] = -4.0
    q, outliers, own = quantize_static_rows(x, float(scale), zero_point)
    assert outliers.tolist() == [2, 4]
    assert torch.equal(own.flatten(), x[[2, 4]].abs().amax(dim=1) / 127)
    inside = x[[0, 1, 3, 5]]
    levels = torch.div(inside, float(scale)).round().add(zero_point).clamp(0, 255) - 128
    assert torch.equal(q[[0, 1, 3, 5]], levels.to(torch.int8))
    assert q[2, 5] == 127 and q[4, 7] == -127  # never clipped: the outlier is the top of its row's own scale


def test_calibration_leaves_the_outlier_tokens_out_of_the_range() -> None:
    observer = TokenRangeObserver(64, MinMaxObserver())
    batches = [_rows(seed) for seed in range(3)]
    for batch in batches:
        observer.update(batch)
    ordinary = torch.cat([b[1:] for b in batches])
    assert int(observer.outlier_rows) == 3 and int(observer.rows) == 48
    assert float(observer.activation.max_val) == float(ordinary.max())
    assert float(observer.activation.min_val) == float(ordinary.min())
    assert float(observer.max_val) == float(torch.cat(batches).max())  # the full range, for display
    peaks = batches[0].abs().amax(dim=1)
    assert float(peaks[0]) > OUTLIER_FACTOR * float(peaks.median())  # the planted row is an outlier by the rule


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sink_token_costs_static_w8a8_its_accuracy_but_not_this_scheme(seed: int) -> None:
    model = _mlp()
    calibration = [_rows(100 + i) for i in range(8)]
    models = {}
    for scheme in ("static", "static_outliers"):
        prepared = fxquant.prepare(model, (calibration[0],), QuantConfig(scheme=scheme, activation="minmax",
                                                                         bias_correction=False))
        fxquant.calibrate(prepared, calibration, progress=False)
        models[scheme] = fxquant.convert(prepared)
    assert [type(_layer(models["static_outliers"], p)) for p in PATHS] == [StaticOutliersInt8Linear] * 3
    x = _rows(seed)
    with torch.no_grad():
        reference = model(x)
        outputs = {scheme: qmodel(x) for scheme, qmodel in models.items()}
    mine = outputs["static_outliers"]
    ordinary, sink = _sqnr(reference[1:], mine[1:]), _sqnr(reference[:1], mine[:1])
    static = _sqnr(reference[1:], outputs["static"][1:])
    assert ordinary > ORDINARY_FLOOR and sink > SINK_FLOOR, f"static_outliers: {ordinary:.1f} / {sink:.1f} dB"
    assert static < STATIC_CEILING, f"plain static kept {static:.1f} dB on the ordinary rows: the case is not planted"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smoothquant_gives_the_ordinary_tokens_back_what_outlier_channels_took(
        seed: int, caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    calibration = [_channel_rows(100 + i) for i in range(8)]
    models = {}
    for alpha in (None, "auto"):
        with caplog.at_level(logging.WARNING, logger="fxquant"):
            prepared = fxquant.prepare(model, (calibration[0],), QuantConfig(
                scheme="static_outliers", smoothquant_alpha=alpha, activation="minmax", bias_correction=False))
        fxquant.calibrate(prepared, calibration, progress=False)
        models[alpha] = fxquant.convert(prepared)
    assert not any("does not reach" in r.getMessage() for r in caplog.records)  # smoothing reaches these layers
    smoothed = models["auto"]
    assert set(smoothquant_alphas(smoothed)) == set(PATHS) and smoothquant_alphas(smoothed)["0"] is not None
    assert _layer(smoothed, "0").input_scale is not None  # the model input's 1/s, taken into the layer
    x = _channel_rows(seed)
    with torch.no_grad():
        reference, plain, mine = model(x), models[None](x), smoothed(x)
    ordinary, sink = _sqnr(reference[1:], mine[1:]), _sqnr(reference[:1], mine[:1])
    assert ordinary > SMOOTHED_FLOOR and sink > SMOOTHED_SINK_FLOOR, f"smoothed: {ordinary:.1f} / {sink:.1f} dB"
    unsmoothed = _sqnr(reference[1:], plain[1:])
    assert unsmoothed < UNSMOOTHED_CEILING, f"unsmoothed kept {unsmoothed:.1f} dB: the case is not planted"


def test_the_smoothed_range_is_the_ordinary_tokens_range_of_the_scaled_input() -> None:
    observer = TokenRangeObserver(64, MinMaxObserver())
    batches = [_channel_rows(seed) for seed in range(3)]
    for batch in batches:
        observer.update(batch)
    inverse = torch.logspace(-2, 1, 64)[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    observer.smooth(inverse)
    scaled = torch.cat([b[1:] for b in batches]) * inverse  # the ordinary rows, as the layer will read them
    assert isinstance(observer.activation, MinMaxObserver)
    assert torch.equal(observer.activation.min_val, scaled.min()) and torch.equal(observer.activation.max_val,
                                                                                  scaled.max())


def test_a_smoothed_layer_scales_its_input_before_it_quantizes() -> None:
    layer = _layer_with_range(-3.0, 3.5)
    layer.input_scale = torch.linspace(0.2, 1.5, 64)
    x = _rows(4, 8, sink=False)
    x[3] *= 10
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, _recomputed(x * layer.input_scale, layer), rtol=2e-6, atol=1e-5)


def test_the_automatic_alpha_simulates_the_outlier_tokens_at_their_own_scale() -> None:
    """With a sink among the sampled rows, the per-tensor simulation's range is stretched by it; this scheme's
    leaves the sink out, as calibration does, so its error is smaller."""
    rows = torch.cat([_channel_rows(seed) for seed in range(8)])
    layers = [(torch.randn(24, 64, generator=torch.Generator().manual_seed(5)), "per_channel")]
    assert candidate_error(rows, layers, None, outlier_tokens=True) < 0.5 * candidate_error(rows, layers, None)  # 0.2x


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_save_and_load_give_the_same_model(tmp_path: Path, alpha: float | None) -> None:
    model = _mlp()
    prepared = fxquant.prepare(model, (_rows(0),), QuantConfig(scheme="static_outliers", smoothquant_alpha=alpha))
    fxquant.calibrate(prepared, [_rows(i) for i in range(4)], progress=False)
    qmodel = fxquant.convert(prepared)
    loaded = fxquant.load(fxquant.save(qmodel, tmp_path / "outliers"), model)
    for path in PATHS:
        assert torch.equal(_layer(loaded, path).input_qparams, _layer(qmodel, path).input_qparams), path
    assert (_layer(loaded, "0").input_scale is None) == (alpha is None)  # the model input's 1/s, when smoothed
    x = _rows(9)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))


def test_it_is_never_built_without_a_calibrated_range() -> None:
    with pytest.raises(TypeError, match="from_observed"):
        StaticOutliersInt8Linear.from_float(nn.Linear(8, 4), "per_channel")


def test_convert_cannot_switch_calibrated_layers_to_it() -> None:
    prepared = fxquant.prepare(_mlp(), (_rows(0),), QuantConfig(scheme="static"))
    fxquant.calibrate(prepared, [_rows(1)], progress=False)
    with pytest.raises(ConfigError, match="static_outliers"):
        fxquant.convert(prepared, schemes={"*": "static_outliers"})


def test_converting_it_uncalibrated_is_a_calibration_error() -> None:
    prepared = fxquant.prepare(_mlp(), (_rows(0),), QuantConfig(scheme="static_outliers"))
    with pytest.raises(CalibrationError, match=r"saw no data.*fxquant.calibrate"):
        fxquant.convert(prepared)


def test_a_layer_whose_token_ranges_saw_nothing_stays_float_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """As a branch calibration never took: the other layers convert, that one stays float and is named."""
    prepared = fxquant.prepare(_mlp(), (_rows(0),), QuantConfig(scheme="static_outliers"))
    fxquant.calibrate(prepared, [_rows(i) for i in range(4)], progress=False)
    name, observer = next((n, m) for n, m in prepared.named_modules() if isinstance(m, TokenRangeObserver)
                          and m.label.endswith(" 4"))
    fresh = TokenRangeObserver(observer.in_features, MinMaxObserver())
    fresh.label, fresh.activation.label = observer.label, observer.activation.label
    prepared.add_submodule(name, fresh)
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        qmodel = fxquant.convert(prepared)
    assert [type(_layer(qmodel, p)) for p in PATHS] == [StaticOutliersInt8Linear] * 2 + [nn.Linear]
    assert any("input of 4 saw no calibration data" in r.getMessage() for r in caplog.records)


def test_every_smoothed_layer_of_a_decoder_reports_its_alpha() -> None:
    """A decoder's attention Linears are islands of one layer each, unwrapped at convert: what SmoothQuant chose
    for them must stay readable (smoothquant_alphas), as it does for the layers still inside a graph."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    windows = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    prepared = fxquant.prepare(model, (windows[0],), QuantConfig(scheme="static_outliers", smoothquant_alpha=0.5))
    fxquant.calibrate(prepared, windows, progress=False)
    qmodel = fxquant.convert(prepared)
    layers = {path for path, m in qmodel.named_modules() if isinstance(m, StaticOutliersInt8Linear)}
    assert len(layers) == 2 * 7 + 1  # q, k, v, o, gate, up, down of each layer, and the head
    assert smoothquant_alphas(qmodel) == dict.fromkeys(sorted(layers), 0.5)

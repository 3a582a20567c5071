"""``QuantConfig(scheme="dynamic_group")`` end to end: W8A8 with one activation scale per group of inputs of each row
(:class:`~fxquant.nn.schemes.DynamicGroupInt8Linear`).

Like the per-token scheme it needs no calibration; every converted model is checked against a layer-by-layer
re-computation written here from each INT8 module's own ``int8_weight()``/``weight_scale``/``bias`` (bit for bit),
and against the float model (SQNR floors a few dB under the measured value). The layer's weights are the per-token
scheme's bytes in another layout; saving and loading, ``convert(schemes=...)`` and coverage treat it as a scheme of
its own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxquant
from fxquant.calibration import observers_of
from fxquant.config import QuantConfig
from fxquant.models import mlp_net
from fxquant.nn.fused import Fused
from fxquant.nn.quantized import QuantizedLinear
from fxquant.nn.schemes import DynamicGroupInt8Linear, DynamicInt8Linear, SchemeLinear
from fxquant.observers import get_weight_observer
from fxquant.state import graph_of

# mlp_net's Linears (ReLU after 0 and 2) at two widths: test_schemes.py's (groups of 64 and 32: one group, three)
# and one whose inputs split into groups of 128 (two and three of them)
WIDTHS = {"narrow": (64, 96, 40), "wide": (256, 384, 40)}
GROUPS = {"narrow": {"0": 64, "2": 32, "4": 32}, "wide": {"0": 128, "2": 128, "4": 128}}
PATHS = ("0", "2", "4")
# measured (seeded inputs, rows 1/4/16): narrow 38.5-40.8 dB, wide 37.6-38.4 dB; the floor is 3 dB under the lowest
SQNR_FLOOR = 34.5
# a calibrated static MLP switched to dynamic_group at convert measures 40.2 dB (narrow, 16 rows)
CONVERT_FLOOR = 37.0
# a dequantized weight is within half a step of the float one, plus float32 rounding (test_schemes.py says why)
HALF_STEP = 0.5 + 2.0**-15


def _mlp(width: str = "narrow") -> nn.Sequential:
    in_features, hidden, out_features = WIDTHS[width]
    return mlp_net(in_features=in_features, hidden=hidden, out_features=out_features, layers=3)


def _batch(width: str, rows: int, seed: int) -> tuple[torch.Tensor]:
    return (torch.randn(rows, WIDTHS[width][0], generator=torch.Generator().manual_seed(seed)),)


def _layer(qmodel: nn.Module, path: str) -> nn.Module:
    """The computing module at ``path`` of a converted model (inside ``Fused`` where an activation was fused)."""
    module = graph_of(qmodel).get_submodule(path)
    return module.inner if isinstance(module, Fused) else module


def _sqnr(reference: torch.Tensor, output: torch.Tensor) -> float:
    ref, out = reference.double(), output.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum()))


def _per_group(x: torch.Tensor, layer: DynamicGroupInt8Linear) -> torch.Tensor:
    """One layer from its own buffers: each ``layer.group`` inputs of each row to int8 with scale max|x| / 127
    (float32, at least float32's tiny), each group's integer sums in float64 rounded to float32, then in float32
    ``out = out + sum_g * scale_g`` group by group, ``* weight_scale``, ``+ bias``."""
    count, group = x.shape[0], layer.group
    values = x.reshape(count, -1, group)
    scale = values.abs().amax(dim=2).div(127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.div(values, scale[..., None]).round().clamp(-127, 127).double()
    weight = layer.int8_weight().double().view(layer.out_features, -1, group)
    out = torch.zeros(count, layer.out_features)
    for g in range(values.shape[1]):
        out = out + (q[:, g] @ weight[:, g].t()).to(torch.float32) * scale[:, g:g + 1]
    out = out * layer.weight_scale
    return out if layer.bias is None else out + layer.bias


def _recomputed(qmodel: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for path in PATHS:
        layer = _layer(qmodel, path)
        assert isinstance(layer, DynamicGroupInt8Linear), (path, type(layer))
        x = _per_group(x, layer)
        x = x if path == "4" else torch.relu(x)
    return x


def _calibrated_static(model: nn.Module) -> Any:
    prepared = fxquant.prepare(model, _batch("narrow", 4, 0))
    fxquant.calibrate(prepared, [_batch("narrow", 16, seed) for seed in range(1, 5)], progress=False)
    return prepared


# --- QuantConfig(scheme="dynamic_group") --------------------------------------------------------------------------
@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize("width", list(WIDTHS))
def test_dynamic_group_model_needs_no_calibration_and_is_its_layers_recomputed(width: str) -> None:
    model = _mlp(width)
    prepared = fxquant.prepare(model, _batch(width, 4, 0), QuantConfig(scheme="dynamic_group"))
    assert observers_of(prepared) == {}, list(observers_of(prepared))
    qmodel = fxquant.convert(prepared)  # no calibrate(): nothing to calibrate
    for path in PATHS:
        layer = _layer(qmodel, path)
        assert type(layer) is DynamicGroupInt8Linear, (path, type(layer))
        assert layer.group == GROUPS[width][path], (path, layer.group)
        assert isinstance(graph_of(qmodel).get_submodule(path), Fused) == (path != "4"), path  # ReLU fused
        float_linear = model.get_submodule(path)
        assert (layer.in_features, layer.out_features) == (float_linear.in_features, float_linear.out_features)
    for rows in (1, 4, 16):
        (x,) = _batch(width, rows, 9 + rows)
        with torch.no_grad():
            got, want = qmodel(x), model(x)
        assert torch.equal(got, _recomputed(qmodel, x)), rows
        sqnr = _sqnr(want, got)
        assert sqnr > SQNR_FLOOR, f"{width} dynamic_group MLP, {rows} rows: SQNR {sqnr:.2f} dB"


# --- the layer ----------------------------------------------------------------------------------------------------
def test_from_float_keeps_the_per_token_weight_bytes() -> None:
    linear = nn.Linear(256, 50)
    layer = DynamicGroupInt8Linear.from_float(linear, "per_channel")
    per_token = DynamicInt8Linear.from_float(linear, "per_channel")
    assert type(layer) is DynamicGroupInt8Linear and layer.scheme == "dynamic_group" and layer.group == 128
    assert torch.equal(layer.int8_weight(), per_token.qweight)
    assert torch.equal(layer.weight_scale, per_token.weight_scale)
    assert layer.bias is not None and torch.equal(layer.bias, linear.bias)
    weight = layer.weight  # the dequantized float weight
    assert weight.dtype == torch.float32 and weight.shape == linear.weight.shape
    steps = (weight.double() - linear.weight.detach().double()).abs() / layer.weight_scale.double()[:, None]
    assert float(steps.max()) <= HALF_STEP, f"worst error {float(steps.max()):.6f} steps"
    state = layer.state_dict()
    assert set(state) == {"qweight", "weight_scale", "bias"}, sorted(state)  # no group_sums: derived from qweight
    assert state["qweight"].dtype == torch.int8 and state["qweight"].shape == (2, 64, 32, 4)  # 50 outputs padded to 64


@pytest.mark.parametrize("in_features", [6, 130])
def test_inputs_not_a_multiple_of_4_fall_back_to_per_token(in_features: int) -> None:
    linear = nn.Linear(in_features, 12)
    layer = DynamicGroupInt8Linear.from_float(linear, "per_channel")
    assert type(layer) is DynamicInt8Linear and layer.scheme == "dynamic", type(layer)
    assert torch.equal(layer.qweight, DynamicInt8Linear.from_float(linear, "per_channel").qweight)
    with pytest.raises(ValueError, match="multiple of 4"):  # built directly, it says why
        DynamicGroupInt8Linear(linear.weight, get_weight_observer("per_channel")().qparams(linear.weight.detach()),
                               None)


@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize("layer_type", [DynamicGroupInt8Linear, DynamicInt8Linear])
@pytest.mark.parametrize("rows", [1, 5])  # the per-token layer's VNNI rows loop (sums of weights) runs up to 8 rows
def test_a_loaded_state_dict_computes_the_saved_layer(layer_type: type[SchemeLinear], rows: int) -> None:
    """The state dict holds no weight sums, so a layer that loads another's state dict must not keep the sums of
    its own former weights: the C loops subtract them from every sum."""
    source = layer_type.from_float(nn.Linear(256, 50), "per_channel")
    target = layer_type.from_float(nn.Linear(256, 50), "per_channel")
    target.load_state_dict(source.state_dict())
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(20))
    with torch.no_grad():
        got, want = target(x), source(x)
    assert torch.equal(got, want), f"largest difference {float((got - want).abs().max()):.3g}"


# --- convert(schemes=...), save / load ----------------------------------------------------------------------------
def test_convert_schemes_switches_the_linears_to_dynamic_group() -> None:
    model = _mlp()
    prepared = _calibrated_static(model)
    qmodel = fxquant.convert(prepared, schemes={"*": "dynamic_group"})
    assert [type(_layer(qmodel, p)) for p in PATHS] == [DynamicGroupInt8Linear] * 3
    one = fxquant.convert(prepared, schemes={"2": "dynamic_group"})
    assert [type(_layer(one, p)) for p in PATHS] == [QuantizedLinear, DynamicGroupInt8Linear, QuantizedLinear]
    (x,) = _batch("narrow", 16, 13)
    with torch.no_grad():
        got = qmodel(x)
        assert torch.equal(got, _recomputed(qmodel, x))
        sqnr = _sqnr(model(x), got)
    assert sqnr > CONVERT_FLOOR, f"calibrated static MLP switched to dynamic_group: SQNR {sqnr:.2f} dB"


def _assert_round_trip(qmodel: nn.Module, model: nn.Module, path: Path, width: str) -> None:
    loaded = fxquant.load(fxquant.save(qmodel, path), model)
    for name in PATHS:
        layer, saved = _layer(loaded, name), _layer(qmodel, name)
        assert type(layer) is DynamicGroupInt8Linear and isinstance(saved, DynamicGroupInt8Linear), name
        assert torch.equal(layer.qweight, saved.qweight) and torch.equal(layer.group_sums, saved.group_sums), name
    for rows in (3, 16):
        x = _batch(width, rows, 14)
        with torch.no_grad():
            assert torch.equal(loaded(*x), qmodel(*x)), rows


@pytest.mark.parametrize("width", list(WIDTHS))
def test_save_load_config_scheme(tmp_path: Path, width: str) -> None:
    model = _mlp(width)
    qmodel = fxquant.convert(fxquant.prepare(model, _batch(width, 4, 0), QuantConfig(scheme="dynamic_group")))
    _assert_round_trip(qmodel, model, tmp_path / "dynamic_group", width)


def test_save_load_convert_schemes(tmp_path: Path) -> None:
    model = _mlp()
    qmodel = fxquant.convert(_calibrated_static(model), schemes={"*": "dynamic_group"})
    _assert_round_trip(qmodel, model, tmp_path / "switched", "narrow")


# --- coverage -----------------------------------------------------------------------------------------------------
def test_coverage_names_the_scheme_and_counts_its_macs_as_int8() -> None:
    qmodel = fxquant.convert(fxquant.prepare(_mlp(), _batch("narrow", 4, 0), QuantConfig(scheme="dynamic_group")))
    report = fxquant.coverage(qmodel, _batch("narrow", 5, 15))
    rows = {row.path: row for row in report.layers}
    assert {p: (r.quantized, r.scheme) for p, r in rows.items()} == {p: (True, "dynamic_group") for p in PATHS}
    in_features, hidden, out_features = WIDTHS["narrow"]
    assert {p: r.macs for p, r in rows.items()} == \
        {"0": 5 * in_features * hidden, "2": 5 * hidden * hidden, "4": 5 * hidden * out_features}
    assert report.int8_mac_fraction == 1.0, report.int8_mac_fraction
    summary = str(report).splitlines()[-1]
    assert "3/3" in summary and "weight-only" not in summary, summary


def test_smoothquant_on_a_scheme_at_prepare_warns_that_it_does_not_reach_those_layers(
        caplog: pytest.LogCaptureFixture) -> None:
    """Scheme layers observe nothing at prepare, so ``smoothquant_alpha`` cannot smooth them: prepare says so and
    names the way that works (static at prepare, the scheme at convert); a static prepare is not warned about."""
    example = _batch("narrow", 4, 0)
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        fxquant.prepare(_mlp(), example, QuantConfig(scheme="dynamic_group", smoothquant_alpha=0.5))
    warned = [r.getMessage() for r in caplog.records if "smoothquant_alpha" in r.getMessage()]
    assert len(warned) == 1 and "3 Linear(s)" in warned[0] and "scheme='static'" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxquant"):  # one layer on the scheme by an override: named so
        fxquant.prepare(_mlp(), example, QuantConfig(scheme="static", smoothquant_alpha=0.5,
                                                      overrides={"4": {"scheme": "dynamic_group"}}))
    warned = [r.getMessage() for r in caplog.records if "smoothquant_alpha" in r.getMessage()]
    assert len(warned) == 1 and "1 Linear(s) on a float-in, float-out scheme (dynamic_group)" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        fxquant.prepare(_mlp(), example, QuantConfig(scheme="static", smoothquant_alpha=0.5))
    assert not [r for r in caplog.records if "smoothquant_alpha" in r.getMessage()]

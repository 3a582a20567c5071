"""``backend="auto"``: measured per-layer choice within one activation representation, recorded per layer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxquant
from fxquant.errors import InputError
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.models import create_model
from fxquant.runtime.auto_backend import FAMILIES
from fxquant.testing import assert_sqnr, calibrated


def test_auto_picks_available_backends_of_one_representation_and_stays_accurate() -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=16),
                          nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10)).eval()
    prepared = calibrated(model, (4, 3, 8, 8))
    qmodel = fxquant.convert(prepared, backend="auto")
    chosen = {row.backend for row in fxquant.coverage(qmodel).layers}
    assert chosen <= set(available_backends()), chosen
    assert any(chosen <= set(family) for family in FAMILIES), f"auto mixed representations: {chosen}"
    x = torch.randn(4, 3, 8, 8)
    assert_sqnr(model(x), qmodel(x), 25.0, "auto")
    # fbgemm's depthwise kernel needs 7-bit inputs: auto may only move the grouped conv where its qparams fit
    depthwise = qmodel.get_submodule("2")
    assert depthwise.backend.activation_qrange(feeds_grouped_conv=True)[1] >= depthwise.in_qp.qmax


def test_auto_measures_on_the_deployment_batch_it_is_given() -> None:
    """The fastest kernel depends on the batch size, so auto times every layer on the inputs passed to convert."""
    from fxquant.runtime import auto_backend as auto

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    prepared = fxquant.prepare(model, (torch.randn(1, 32),))  # the example batch is 1; deployment batches are 48
    fxquant.calibrate(prepared, [torch.randn(64, 32) for _ in range(8)], progress=False)
    auto._CACHE.clear()
    qmodel = fxquant.convert(prepared, backend="auto", example_inputs=(torch.randn(48, 32),))
    timed_shapes = {key[5] for key in auto._CACHE}  # _layer_key: (cpu, backend, type, weight, spec, input shape, ...)
    if any(len(family) > 1 for family in auto._families()):  # one member per family: nothing to time per layer
        assert timed_shapes == {(48, 32), (48, 64)}, timed_shapes
    x = torch.randn(48, 32)
    assert_sqnr(model(x), qmodel(x), 25.0, "auto at batch 48")


def test_auto_example_inputs_errors_name_the_cause() -> None:
    model = nn.Sequential(nn.Linear(32, 8)).eval()
    prepared = calibrated(model, (1, 32))
    with pytest.raises(fxquant.errors.InputError, match="backend here is 'fbgemm'"):
        fxquant.convert(prepared, backend="fbgemm", example_inputs=(torch.randn(4, 32),))
    with pytest.raises(fxquant.errors.InputError, match=r"does not run on Tensor\(4, 7\)"):
        fxquant.convert(prepared, backend="auto", example_inputs=(torch.randn(4, 7),))


def _no_timing(*args: object, **kwargs: object) -> dict[str, float]:
    raise AssertionError("auto measured kernels while replaying recorded choices")


def test_recorded_choices_replay_without_measuring_and_survive_save_and_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto's choice flips with machine load; a saved auto model must load as it was saved, not re-measured (an
    artifact whose last Linear had moved between the fbgemm and onednn families failed its graph check on load)."""
    from fxquant.runtime import auto_backend as auto

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).eval()
    prepared = calibrated(model, (4, 3, 6, 6))
    qmodel = fxquant.convert(prepared, backend="auto")
    choices = fxquant.api.quant_state(qmodel).layer_backends
    assert sorted(choices) == ["0", "3"]
    assert choices == {row.path: row.backend for row in fxquant.coverage(qmodel).layers}
    fxquant.save(qmodel, tmp_path / "auto-int8")
    monkeypatch.setattr(auto, "_fastest", _no_timing)
    x = torch.randn(3, 3, 6, 6)
    for replayed in (fxquant.convert(prepared, backend="auto", layer_backends=choices),
                     fxquant.load(tmp_path / "auto-int8", model)):
        assert {row.path: row.backend for row in fxquant.coverage(replayed).layers} == choices
        torch.testing.assert_close(replayed(x), qmodel(x), rtol=0, atol=0)


def test_bad_recorded_choices_are_one_clear_error() -> None:
    prepared = calibrated(nn.Sequential(nn.Linear(8, 4)).eval(), (4, 8))
    with pytest.raises(InputError, match=re.escape("layer_backends=...) is for backend='auto'")):
        fxquant.convert(prepared, backend="reference", layer_backends={"0": "reference"})
    with pytest.raises(InputError, match="'missing', which is not a quantized Linear/Conv"):
        fxquant.convert(prepared, backend="auto", layer_backends={"missing": "onednn"})
    if {"fbgemm", "onednn"} <= set(available_backends()):
        with pytest.raises(InputError, match="one auto family"):
            fxquant.convert(prepared, backend="auto", layer_backends={"0": "onednn", "1": "fbgemm"})


ALL_THREE = {"fbgemm", "qnnpack", "onednn"} <= set(available_backends())
needs_all_three = pytest.mark.skipif(not ALL_THREE, reason="needs the fbgemm, qnnpack and onednn backends")
MIX = "fbgemm+qnnpack per layer"


def _layers(qmodel: torch.nn.Module) -> dict[str, str]:
    return {row.path: row.backend for row in fxquant.coverage(qmodel).layers}


def _rigged(monkeypatch: pytest.MonkeyPatch, layer_pick: dict[type, str], medians: dict[str, float]
            ) -> dict[str, tuple[torch.Size, ...]]:
    """Per-layer timings that crown ``layer_pick[type(layer)]``, whole-model medians from ``medians``; returns the
    whole-model candidates offered, each with the input shapes it was timed on."""
    from fxquant.runtime import auto_backend as auto

    def time_layer(module: object, names: list[str], x: torch.Tensor) -> dict[str, float]:
        return {name: 1.0 if name == layer_pick[type(module)] else 9.0 for name in names}

    offered: dict[str, tuple[torch.Size, ...]] = {}

    def time_models(models: dict[str, object], example: tuple[torch.Tensor, ...]) -> dict[str, float]:
        offered.update({name: tuple(x.shape for x in example) for name in models})
        return {name: medians.get(name, 50.0) for name in models}

    monkeypatch.setattr(auto, "_time_layer", time_layer)
    monkeypatch.setattr(auto, "_time_models", time_models)
    return offered


def _conv_bn() -> tuple[nn.Module, torch.fx.GraphModule]:
    model = create_model("conv_bn", channels=8)
    return model, calibrated(model, (2, 3, 32, 32))


@needs_all_three
def test_auto_keeps_the_fastest_whole_model_when_layer_timings_point_elsewhere(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Layer timings that crown qnnpack everywhere must not beat an onednn whole model measured faster."""
    from fxquant.nn.quantized import QuantizedConv2d, QuantizedLinear

    _, prepared = _conv_bn()
    offered = _rigged(monkeypatch, {QuantizedConv2d: "qnnpack", QuantizedLinear: "qnnpack"},
                      {"onednn": 4.0, "qnnpack": 31.0, "fbgemm": 20.0})
    example = (torch.randn(3, 3, 32, 32),)
    with caplog.at_level("INFO", logger="fxquant.runtime.auto_backend"):
        qmodel = fxquant.convert(prepared, backend="auto", example_inputs=example)
    # the mix is qnnpack everywhere, the same model as qnnpack alone: built and timed once
    assert offered == dict.fromkeys(("fbgemm", "qnnpack", "onednn"), ((3, 3, 32, 32),)), offered
    assert _layers(qmodel) == {"conv": "onednn", "fc": "onednn"}
    assert fxquant.api.quant_state(qmodel).layer_backends == {"conv": "onednn", "fc": "onednn"}
    assert "onednn 4.000 ms" in caplog.text and "qnnpack 31.000 ms" in caplog.text and "kept onednn" in caplog.text
    x = torch.randn(3, 3, 32, 32)
    assert torch.equal(qmodel(x), fxquant.convert(prepared, backend="onednn")(x))


@needs_all_three
@pytest.mark.parametrize("winner", [MIX, "fbgemm", "qnnpack"])
def test_auto_keeps_the_mix_only_when_it_is_the_fastest_whole_model(
        monkeypatch: pytest.MonkeyPatch, winner: str) -> None:
    from fxquant.nn.quantized import QuantizedConv2d, QuantizedLinear

    model, prepared = _conv_bn()
    offered = _rigged(monkeypatch, {QuantizedConv2d: "qnnpack", QuantizedLinear: "fbgemm"}, {winner: 1.0})
    qmodel = fxquant.convert(prepared, backend="auto")
    assert sorted(offered) == sorted(["fbgemm", "qnnpack", "onednn", MIX]), offered
    expected = {"conv": "qnnpack", "fc": "fbgemm"} if winner == MIX else {"conv": winner, "fc": winner}
    assert _layers(qmodel) == expected
    x = torch.randn(3, 3, 32, 32)
    # the reference: the single backend's own conversion, or for the mix the recorded choices replayed. Auto lowers
    # a family with its first member's qparams (fxquant.runtime.auto_backend._family_candidates): qnnpack alone runs on
    # fbgemm's activation ranges (7 bits without VNNI), so its own conversion takes those ranges here
    if winner == "qnnpack":
        monkeypatch.setattr(get_backend("qnnpack"), "activation_qrange", get_backend("fbgemm").activation_qrange)
    reference = (fxquant.convert(prepared, backend=winner) if winner != MIX
                 else fxquant.convert(prepared, backend="auto", layer_backends=expected))
    assert torch.equal(qmodel(x), reference(x))
    assert_sqnr(model(x), qmodel(x), 25.0, f"auto kept {winner}")


def test_whole_models_are_compared_by_median_not_by_one_lucky_call() -> None:
    """A model that is slow in every round but one must lose to one that is steadily faster."""
    import time

    from fxquant.runtime import auto_backend as auto

    calls = {"lucky": 0}

    def lucky() -> None:
        calls["lucky"] += 1
        time.sleep(0.0 if calls["lucky"] == 3 else 0.03)

    def steady() -> None:
        time.sleep(0.003)

    medians = auto._time_models({"lucky": lucky, "steady": steady}, ())  # type: ignore[dict-item]
    assert min(medians, key=medians.__getitem__) == "steady", medians
    assert calls["lucky"] == 1 + auto.MODEL_ROUNDS


def test_rounds_run_candidates_in_shuffled_orders() -> None:
    from fxquant.runtime import auto_backend as auto

    sequence: list[str] = []
    candidates = {name: (lambda name=name: sequence.append(name)) for name in "abc"}
    auto._fastest(candidates, rounds=7)
    rounds = [tuple(sequence[i:i + 3]) for i in range(3, len(sequence), 3)]  # after the warm-up round
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds), rounds
    assert len(set(rounds)) > 1, f"every round ran in one order: {rounds[0]}"

"""``backend="auto"``: measured per-layer choice within one activation representation, recorded per layer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fxquant
from fxquant.auto import FAMILIES
from fxquant.errors import InputError
from fxquant.kernels.registry import available_backends
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
    from fxquant import auto

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
    from fxquant import auto

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

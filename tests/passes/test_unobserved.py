"""``QuantConfig(unobserved=...)``: a branch the calibration data never takes keeps its layers float (default, with
a warning naming them) or refuses the model (``"error"``); a model no data reached is always refused."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import fxquant
from fxquant.errors import CalibrationError
from fxquant.nn.quantized import _QuantizedWeighted
from fxquant.testing import assert_sqnr

FLOOR = 39.0  # dB; measured 42.1 (reference backend, these seeds)


class Routed(nn.Module):
    """Large inputs take ``rare``; calibration data never does. A data-dependent branch: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.common = nn.Linear(16, 16)
        self.rare = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().amax() > 100:
            return self.rare(x)
        return self.common(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 16)
        self.route = Routed()
        self.tail = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.relu(self.route(self.head(x))))


def _prepared(**config: object) -> tuple[nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = Net().eval()
    data = [torch.randn(8, 16) for _ in range(8)]
    prepared = fxquant.prepare(model, (data[0],), fxquant.QuantConfig(backend="reference", **config))
    fxquant.calibrate(prepared, data, progress=False)
    return model, prepared


def test_an_untaken_branch_stays_float_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    model, prepared = _prepared()
    with caplog.at_level(logging.WARNING, logger="fxquant"):
        qmodel = fxquant.convert(prepared)
    assert "route.rare stay float" in caplog.text and "unobserved='error'" in caplog.text, caplog.text
    rows = {row.path: row for row in fxquant.coverage(qmodel).layers}
    assert not rows["route.rare"].quantized and rows["route.rare"].reason == "never ran during calibration"
    assert all(rows[path].quantized for path in ("head", "route.common", "tail")), fxquant.coverage(qmodel)
    assert not any(isinstance(m, _QuantizedWeighted) for m in qmodel.get_submodule("route.rare").modules())
    x = torch.randn(8, 16)
    assert_sqnr(model(x), qmodel(x), FLOOR)  # the calibrated path is INT8 and accurate


def test_the_float_branch_computes_in_float() -> None:
    model, prepared = _prepared()
    qmodel = fxquant.convert(prepared)
    rare = qmodel.get_submodule("route.rare")
    x = 300 * torch.randn(4, 16)
    assert torch.equal(rare(x), model.route.rare(x))  # no quantize or dequantize inside the kept branch


def test_unobserved_error_refuses_naming_the_observers() -> None:
    _, prepared = _prepared(unobserved="error")
    with pytest.raises(CalibrationError, match=r"2 observer\(s\) saw no data: .*route\.rare"):
        fxquant.convert(prepared)


def test_a_model_no_data_reached_is_refused_whatever_the_setting() -> None:
    prepared = fxquant.prepare(Net().eval(), (torch.randn(2, 16),))
    with pytest.raises(CalibrationError, match="saw no data"):
        fxquant.convert(prepared)


def test_unknown_setting_is_a_config_error() -> None:
    with pytest.raises(fxquant.errors.ConfigError, match="unobserved"):
        fxquant.QuantConfig(unobserved="ignore")

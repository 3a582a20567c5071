"""Diagnostics in the summary: too little data, observers that never ran, channels with outlying ranges."""

from __future__ import annotations

import torch
from calib_helpers import assert_identical, batches, observer_state, prepared_tiny
from torch import nn

import fxquant
from fxquant.calibration import CalibrationSummary, ChannelSpread
from fxquant.calibration.diagnostics import MIN_ELEMENTS, needed_elements
from fxquant.observers import MinMaxObserver, PercentileObserver

OUTLIERS = (3, 7)


def planted(layer: nn.Module) -> None:
    """Make output channels ``OUTLIERS`` of ``layer`` (a Linear or Conv) about 1000x larger than the others."""
    assert isinstance(layer, (nn.Linear, nn.Conv2d))
    with torch.no_grad():
        for channel in OUTLIERS:
            layer.weight[channel] *= 1000
            assert layer.bias is not None
            layer.bias[channel] *= 1000


def spread_of(summary: CalibrationSummary, label: str) -> ChannelSpread:
    found = [s for s in summary.channel_spreads if s.label == label]
    assert found, f"no spread reported for {label!r}; got {[s.label for s in summary.channel_spreads]}"
    return found[0]


def test_outlier_channels_of_a_linear_on_tokens_are_reported_on_the_last_axis() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    planted(model[0])
    data = [torch.randn(4, 10, 16) for _ in range(3)]
    prepared = fxquant.prepare(model, (data[0],))
    summary = fxquant.calibrate(prepared, data, progress=False)
    spread = spread_of(summary, "output of 0")
    assert spread.axis == 2 and spread.channels == 32 and spread.count == 2
    assert {c for c, _ in spread.outliers} == set(OUTLIERS) and spread.ratio > 100
    assert "output of 0: 2 of 32 channels" in str(summary)
    assert all("(input of 0)" not in s.label for s in summary.channel_spreads)


def test_outlier_channels_of_a_conv_are_reported_on_axis_1() -> None:
    prepared = prepared_tiny("minmax")
    planted(prepared.get_submodule("conv2"))
    summary = fxquant.calibrate(prepared, batches(2), progress=False)
    spread = spread_of(summary, "output of conv2")
    assert spread.axis == 1 and {c for c, _ in spread.outliers} == set(OUTLIERS)


def test_diagnose_leaves_the_statistics_untouched_and_can_be_turned_off() -> None:
    with_pass, without = prepared_tiny("histogram"), prepared_tiny("histogram")
    fxquant.calibrate(with_pass, batches(3), progress=False)
    summary = fxquant.calibrate(without, batches(3), progress=False, diagnose=False)
    assert summary.channel_spreads == []
    assert_identical(observer_state(with_pass), observer_state(without))


def test_too_few_samples_and_sparse_observers_warn() -> None:
    summary = fxquant.calibrate(prepared_tiny("minmax"), batches(2), progress=False)
    assert summary.samples == 8
    assert any("only 8 calibration samples" in w for w in summary.warnings)
    assert [s.label for s in summary.sparse] == ["output of fc"]  # 8 samples x 4 outputs
    assert summary.sparse[0].elements == 32 and summary.sparse[0].needed == MIN_ELEMENTS
    assert "warning: only 8 calibration samples" in str(summary)


def test_enough_data_gives_no_warning() -> None:
    model = nn.Sequential(nn.Linear(64, 64)).eval()
    data = [torch.randn(32, 64) for _ in range(2)]
    summary = fxquant.calibrate(fxquant.prepare(model, (data[0],)), data, progress=False)
    assert summary.warnings == [] and summary.sparse == [] and summary.channel_spreads == []


def test_percentile_needs_values_beyond_its_percentile() -> None:
    assert needed_elements(PercentileObserver(percentile=99.99)) == 100_000
    assert needed_elements(PercentileObserver(percentile=99.0)) == MIN_ELEMENTS
    assert needed_elements(MinMaxObserver()) == MIN_ELEMENTS


def test_observers_that_never_ran_are_listed() -> None:
    seen, unseen = MinMaxObserver(), MinMaxObserver()
    seen.label, unseen.label = "output of a", "output of b"
    seen(torch.randn(4096))
    summary = CalibrationSummary(batches=1, samples=64, seconds=0.1)
    summary.record_observers({"a": seen, "b": unseen})
    assert summary.unobserved == ["output of b"] and list(summary.ranges) == ["output of a"]
    assert "output of b: saw no data" in str(summary)


def test_a_model_with_many_observers_prints_only_the_widest_ranges() -> None:
    from fxquant.calibration.summary import LISTED_RANGES

    widths = [float(i) for i in range(LISTED_RANGES + 6)]
    summary = CalibrationSummary(1, 1, 0.1, ranges={f"output of {w:g}": (-w, w) for w in widths})
    lines = [line.strip() for line in str(summary).splitlines() if line.startswith("  output of ")]
    assert [line.split(":")[0] for line in lines] == [f"output of {w:g}" for w in widths[::-1][:LISTED_RANGES]]
    assert f"the {LISTED_RANGES} widest of {len(widths)} ranges" in str(summary)
    few = CalibrationSummary(1, 1, 0.1, ranges={"output of a": (0.0, 1.0)})
    assert "widest" not in str(few) and "output of a: [0, 1]" in str(few)

"""``backend="auto"``: measured per-layer choice within one activation representation, recorded per layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.auto import FAMILIES
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

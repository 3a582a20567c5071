"""``backend="auto"``: measured per-layer choice within one activation representation, recorded per layer."""

from __future__ import annotations

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

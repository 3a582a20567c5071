"""The affine formula: error bounds, exact zero, coverage of the observed range."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxquant.qparams import (
    INT8_RANGE,
    REDUCED_UINT8_RANGE,
    UINT8_RANGE,
    affine_qparams,
    dequantize,
    quantize,
    symmetric_qparams,
)

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(lo=finite, hi=finite, qrange=st.sampled_from([UINT8_RANGE, REDUCED_UINT8_RANGE]))
def test_affine_roundtrip_within_half_step_and_zero_exact(lo: float, hi: float, qrange: tuple[int, int]) -> None:
    lo, hi = min(lo, hi), max(lo, hi)
    qp = affine_qparams(torch.tensor(lo), torch.tensor(hi), qrange)
    x = torch.linspace(lo, hi, 101)
    err = (dequantize(quantize(x, qp), qp) - x).abs().max().item()
    step = float(qp.scale)
    assert err <= step / 2 + 1e-6 * max(1.0, abs(lo), abs(hi)), f"max error {err} > half step {step / 2}"
    assert dequantize(quantize(torch.zeros(1), qp), qp).item() == 0.0
    covered = dequantize(torch.tensor([qp.qmin, qp.qmax]), qp)
    assert covered[0] <= min(lo, 0.0) + step and covered[1] >= max(hi, 0.0) - step


@settings(max_examples=100, deadline=None)
@given(amax=st.floats(1e-4, 1e3))
def test_symmetric_weights_zero_point_zero_and_saturate(amax: float) -> None:
    qp = symmetric_qparams(torch.tensor(-amax), torch.tensor(amax))
    assert int(qp.zero_point) == 0 and qp.dtype == torch.int8
    q = quantize(torch.tensor([-10 * amax, 10 * amax]), qp)
    assert q.tolist() == [INT8_RANGE[0], INT8_RANGE[1]]  # saturates at the int8 limits, never wraps


def test_per_channel_with_one_channel_equals_per_tensor() -> None:
    w = torch.randn(1, 8)
    lo, hi = torch.aminmax(w, dim=1)
    per_channel = symmetric_qparams(lo, hi, axis=0)
    per_tensor = symmetric_qparams(w.min(), w.max())
    assert torch.equal(quantize(w, per_channel), quantize(w, per_tensor))

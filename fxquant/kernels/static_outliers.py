"""Static INT8 Linear with outlier tokens at their own scale (``QuantConfig(scheme="static_outliers")``).

A decoder LLM's activations carry a few tokens (the first, some punctuation: attention sinks) 10-1000x larger than
the rest: on SmolLM2-135M the input of one ``down_proj`` reaches 2372 on the first token where 99% of tokens stay
under 46. One calibrated range per tensor sized for them leaves every other token a handful of int8 steps; clipped
to the others' range, the sink loses what it carries. So calibration sets the range from the ordinary tokens only
(:class:`~fxquant.passes.token_ranges.TokenRangeObserver`), and at run time each row (token) that fits the
calibrated range is quantized with it (asymmetric uint8, the static scheme's), while a row with any value outside
it is quantized symmetrically to [-127, 127] with its own scale ``max|x_row| / 127`` (the per-token scheme's), so no
value is ever clipped. Both kinds of row then share one int8 GEMM: the static rows are shifted by -128 into int8,
and their bias holds what the shift took out, ``(128 - zero_point)`` times each output's weight sum, scaled
(:func:`static_bias`).
"""

from __future__ import annotations

import torch

from fxquant import native
from fxquant.kernels.per_token import int8_sums, quantize_rows, rescaled


def fits_range(rows: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """Which rows of 2-d ``rows`` lie within the uint8 range of ``(scale, zero_point)``: bool (rows,)."""
    # amin and amax: on torch 2.13's CPU, aminmax(dim=1) takes ~18x their time on (512, 1536)
    return (rows.amin(dim=1) >= -zero_point * scale) & (rows.amax(dim=1) <= (255 - zero_point) * scale)


def _static_levels(rows: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """uint8 levels of ``rows`` on ``(scale, zero_point)`` minus 128, as int8 (one C pass where the loops run)."""
    out = torch.empty(rows.shape, dtype=torch.int8)
    if native.available("elementwise") and rows.is_contiguous():
        return native.quantize_into(out, rows, native.QuantizeParams(scale, zero_point - 128, -128, 127),
                                    to_nhwc=False)
    return torch.div(rows, scale).round_().add_(zero_point - 128).clamp_(-128, 127).to(torch.int8)


def quantize_static_rows(rows: torch.Tensor, scale: float, zero_point: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, outliers, own)`` for 2-d float32 ``rows``: int8 ``q`` holds each row that fits the calibrated range as
    its uint8 level minus 128, and each row of ``outliers`` (their indices) symmetrically with its own scale
    ``own`` (outliers, 1)."""
    q = _static_levels(rows, scale, zero_point)
    outliers = (~fits_range(rows, scale, zero_point)).nonzero().flatten()
    if not outliers.numel():
        return q, outliers, torch.empty(0, 1)
    q_own, own = quantize_rows(rows.index_select(0, outliers))
    q.index_copy_(0, outliers, q_own)
    return q, outliers, own


def static_bias(weight_sums: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, scale: float,
                zero_point: int) -> torch.Tensor:
    """The bias of the rows that fit the range: their levels are shifted by -128 into int8, so each output's sums
    lack ``(128 - zero_point)`` times its weight sum; in float, times the scales, that is a constant per output."""
    shift = weight_sums.double() * ((128 - zero_point) * scale) * weight_scale.double()
    return (shift if bias is None else shift + bias.double()).float()


def static_outliers_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None, fitted_bias: torch.Tensor, scale: float, zero_point: int,
                           input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x * input_scale`` (``x`` alone without SmoothQuant's float32 ``input_scale``, one per input), ``x`` (...,
    in_features) float, times int8 ``weight`` (out_features, in_features) with float32 per-output ``weight_scale``,
    plus ``bias``; ``(scale, zero_point)`` the calibrated uint8 range of the (scaled) input and ``fitted_bias`` its
    :func:`static_bias`. Float in, float out (see the module docstring)."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"static_outliers_linear: input of shape {tuple(x.shape)} for {in_features} input features")
    rows = x.reshape(-1, in_features).to(torch.float32)
    if input_scale is not None:
        rows = rows * input_scale
    q, outliers, own = quantize_static_rows(rows, scale, zero_point)
    acc = int8_sums(q, weight)
    out = rescaled(acc, torch.full((rows.shape[0], 1), scale), weight_scale, fitted_bias)
    if outliers.numel():
        out.index_copy_(0, outliers, rescaled(acc.index_select(0, outliers), own, weight_scale, bias))
    return out.reshape(*x.shape[:-1], out_features).to(x.dtype)

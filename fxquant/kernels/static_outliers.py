"""Static INT8 Linear with outlier tokens at their own scale (``QuantConfig(scheme="static_outliers")``).

A decoder LLM's activations carry a few tokens (the first, some punctuation: attention sinks) 10-1000x larger than
the rest: on SmolLM2-135M the input of one ``down_proj`` reaches 2372 on the first token where 99% of tokens stay
under 46. One calibrated range per tensor sized for them leaves every other token a handful of int8 steps; clipped
to the others' range, the sink loses what it carries. So calibration sets the range from the ordinary tokens only
(:class:`~fxquant.passes.token_ranges.TokenRangeObserver`), and at run time each row (token) that fits the
calibrated range is quantized with it (asymmetric uint8, the static scheme's), while a row with any value outside
it is quantized symmetrically to [-127, 127] with its own scale ``max|x_row| / 127`` (the per-token scheme's), so no
value is ever clipped. Both kinds of row then share one int8 GEMM: the static rows are shifted by -128 into int8,
and ``(128 - zero_point)`` times each output's weight sum restores their offset in the exact int32 sums.
"""

from __future__ import annotations

import torch

from fxquant.kernels.per_token import int8_sums, quantize_rows, rescaled


def fits_range(rows: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """Which rows of 2-d ``rows`` lie within the uint8 range of ``(scale, zero_point)``: bool (rows,)."""
    lo, hi = torch.aminmax(rows, dim=1)
    return (lo >= -zero_point * scale) & (hi <= (255 - zero_point) * scale)


def quantize_static_rows(rows: torch.Tensor, scale: float, zero_point: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, row_scale, offset)`` for 2-d float32 ``rows``: int8 ``q`` with ``rows ~= (q + offset) * row_scale``;
    rows within the calibrated range get ``scale`` and ``offset = 128 - zero_point`` (uint8 shifted into int8), the
    others their own symmetric scale and offset 0."""
    fits = fits_range(rows, scale, zero_point)
    q = torch.div(rows, scale).round_().add_(zero_point - 128).clamp_(-128, 127).to(torch.int8)
    row_scale = torch.full((rows.shape[0], 1), scale, dtype=torch.float32)
    offset = torch.full((rows.shape[0], 1), 128 - zero_point, dtype=torch.int32)
    outliers = (~fits).nonzero().flatten()
    if outliers.numel():
        q_own, own = quantize_rows(rows.index_select(0, outliers))
        q.index_copy_(0, outliers, q_own)
        row_scale.index_copy_(0, outliers, own)
        offset.index_fill_(0, outliers, 0)
    return q, row_scale, offset


def static_outliers_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None, weight_sums: torch.Tensor, scale: float,
                           zero_point: int) -> torch.Tensor:
    """``x`` (..., in_features) float times int8 ``weight`` (out_features, in_features) with float32 per-output
    ``weight_scale``, plus ``bias``; ``weight_sums`` the int32 sum of each output's weights; ``(scale,
    zero_point)`` the calibrated uint8 input range. Float in, float out (see the module docstring)."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"static_outliers_linear: input of shape {tuple(x.shape)} for {in_features} input features")
    rows = x.reshape(-1, in_features).to(torch.float32)
    q, row_scale, offset = quantize_static_rows(rows, scale, zero_point)
    acc = int8_sums(q, weight)
    acc.addcmul_(offset, weight_sums.view(1, -1))  # |offset| <= 128: exact in int32 up to ~130k inputs
    return rescaled(acc, row_scale, weight_scale, bias).reshape(*x.shape[:-1], out_features).to(x.dtype)

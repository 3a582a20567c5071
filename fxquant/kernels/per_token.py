"""Dynamic per-token INT8 Linear (W8A8-dynamic, the SmoothQuant paper's and torchao's scheme).

Each row of the input (a token) is quantized at run time, symmetrically to [-127, 127] with its own scale
``max|x_row| / 127``; the weights are int8 with one symmetric scale per output channel; ``torch._int_mm`` sums the
int8 products exactly in int32 (oneDNN's VNNI/AMX GEMM on x86), and ``acc * row_scale * weight_scale + bias``
returns float. A row's outliers cost only that row precision: no calibrated range has to cover every token.
SmoothQuant's ``input_scale`` multiplies the rows in the quantize's own pass. Where the C loops run, up to
:data:`LOOP_ROWS` rows (a decode step) are one call that quantizes, sums on VNNI and rescales
(``fxquant/native/csrc/int8_rows.c``): at batch 1 the torch ops and Python steps of the unfused path cost as much
as the sums. More rows take ``torch._int_mm`` between a quantize and a rescale of one C pass each
(``elementwise.c``). Every path gives the same bytes as the torch steps that stand in for them elsewhere.
"""

from __future__ import annotations

import torch

from fxquant.kernels.reference import int_mm_is_exact
from fxquant.native.per_token import int8_rows_into, quantize_rows_into, rescale_rows_into

EXACT_RUN = 1024  # inputs per float32 GEMM where torch._int_mm is not exact (see int8_sums)
LOOP_ROWS = 8  # the VNNI loop up to this many rows, torch._int_mm beyond (docs/quantization.md "Schemes")
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row: every value quantizes to 0


def quantize_rows(rows: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of 2-d float32 ``rows`` (times float32 ``input_scale``, one per column, where given):
    ``(q, scale)`` with ``rows * input_scale ~= q * scale``, scale (M, 1) (one C pass where the loops run, the same
    bytes as the torch steps)."""
    if rows.stride(-1) == 1 and rows.shape[1] > 0:
        q = torch.empty(rows.shape, dtype=torch.int8)
        scale = torch.empty(rows.shape[0], 1, dtype=torch.float32)
        if quantize_rows_into(q, scale, rows, input_scale):
            return q, scale
    if input_scale is not None:
        rows = rows * input_scale
    scale = rows.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_(min=_TINY)
    return torch.div(rows, scale).round_().clamp_(-127, 127).to(torch.int8), scale


def int8_sums(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact int32 ``q @ weight.T`` of int8 ``q`` (rows, in_features) and ``weight`` (out_features,
    in_features)."""
    weight_t = weight.t()  # the layout torch._int_mm reads fastest
    # torch 2.13's CPU _int_mm returns wrong sums for a single input feature, and, where oneDNN has no VNNI, sums
    # pairs of products in int16 (saturating): float32 GEMMs over short runs of inputs are exact there
    return torch._int_mm(q, weight_t) if q.shape[1] > 1 and int_mm_is_exact() else _exact_sums(q, weight_t)


def _exact_sums(q: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``q @ weight_t`` in int32 by float32 GEMMs over runs of :data:`EXACT_RUN` inputs: every partial sum is an
    integer below ``127 * 128 * EXACT_RUN < 2**24``, so float32 holds it exactly in any order of summation."""
    acc = torch.zeros(q.shape[0], weight_t.shape[1], dtype=torch.int32)
    for start in range(0, q.shape[1], EXACT_RUN):
        stop = start + EXACT_RUN
        acc += torch.mm(q[:, start:stop].to(torch.float32), weight_t[start:stop].to(torch.float32)).to(torch.int32)
    return acc


def rescaled(acc: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(acc.shape, dtype=torch.float32)
    if acc.is_contiguous() and rescale_rows_into(out, acc, scale, weight_scale, bias):
        return out
    out = acc.to(torch.float32).mul_(scale).mul_(weight_scale)
    return out if bias is None else out.add_(bias)


def per_token_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, *,
                     weight_sums: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x * input_scale`` (``x`` alone without SmoothQuant's float32 ``input_scale``, one per input), ``x`` (...,
    in_features) float, times dense int8 ``weight`` (out_features, in_features) with float32 per-output
    ``weight_scale``, plus float32 ``bias``; float in, float out.

    With ``weight_sums`` (the int32 sums of each output's weights), up to :data:`LOOP_ROWS` dense float32 rows are
    one call of the VNNI loop, which reads the weights as they lie (``torch._int_mm`` repacks them on every call)
    and quantizes and rescales in the same call; the same bytes either way."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"per_token_linear: input of shape {tuple(x.shape)} for {in_features} input features")
    rows = x if x.dtype == torch.float32 else x.to(torch.float32)
    if weight_sums is not None and rows.numel() <= LOOP_ROWS * in_features and rows.is_contiguous():
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        if int8_rows_into(out, rows, weight, weight_sums, weight_scale, bias, input_scale):
            return out if rows is x else out.to(x.dtype)
    q, scale = quantize_rows(rows.reshape(-1, in_features), input_scale)
    return rescaled(int8_sums(q, weight), scale, weight_scale, bias).reshape(*x.shape[:-1], out_features).to(x.dtype)

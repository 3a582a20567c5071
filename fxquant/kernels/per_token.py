"""Dynamic per-token INT8 Linear (W8A8-dynamic, the SmoothQuant paper's and torchao's scheme).

Each row of the input (a token) is quantized at run time, symmetrically to [-127, 127] with its own scale
``max|x_row| / 127``; the weights are int8 with one symmetric scale per output channel; ``torch._int_mm`` sums the
int8 products exactly in int32 (oneDNN's VNNI/AMX GEMM on x86), and ``acc * row_scale * weight_scale + bias``
returns float. A row's outliers cost only that row precision: no calibrated range has to cover every token.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row: every value quantizes to 0


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of 2-d float32 ``rows``: ``(q, scale)`` with ``rows ~= q * scale``, scale (M, 1)."""
    scale = rows.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_(min=_TINY)
    return torch.div(rows, scale).round_().clamp_(-127, 127).to(torch.int8), scale


def per_token_linear(x: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` (..., in_features) float times int8 ``weight_t`` (in_features, out_features; the transposed view of a
    dense (out, in) weight, the layout ``torch._int_mm`` reads fastest) with float32 per-output ``weight_scale``,
    plus float32 ``bias``; float in, float out."""
    in_features, out_features = weight_t.shape
    q, scale = quantize_rows(x.reshape(-1, in_features).to(torch.float32))
    # torch 2.13's CPU _int_mm returns wrong sums for a single input feature; the outer product is exact there
    acc = torch._int_mm(q, weight_t) if in_features > 1 else q.to(torch.int32) * weight_t.to(torch.int32)
    out = acc.to(torch.float32).mul_(scale).mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    return out.reshape(*x.shape[:-1], out_features).to(x.dtype)

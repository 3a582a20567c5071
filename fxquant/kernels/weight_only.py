"""Weight-only INT8 Linear (W8A16): int8 weights with float scales, float activations.

``out = x @ (weight * scale).T + bias``, one scale per group of :data:`GROUP` inputs of each output
(:class:`~fxquant.nn.schemes.WeightOnlyInt8Linear` quantizes so; the kernels take one scale per output too). A
decode step of an LLM multiplies a few rows by every weight once, so it is bound by the bytes of weight read: the
C loop (``fxquant/native/csrc/weight_only.c``) reads the int8 weights and widens them in registers, a quarter of a
float32 Linear's traffic. Above :data:`LOOP_ROWS` rows (a
prefill) the same weights are dequantized a block of output channels at a time into a reused scratch buffer and
multiplied by torch's float GEMM, which is compute-bound there; no float copy of the weights is kept between calls.
Inputs of another float dtype are computed in float32 and returned in their dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxquant import native
from fxquant.native.weight_only import weight_only_into

GROUP = 64  # inputs per weight scale (llama.cpp's Q8_0 takes 32; docs/quantization.md "Schemes" measures both)
LOOP_ROWS = 8  # the C loop up to this many rows; torch's GEMM beyond (docs/quantization.md "Schemes" measures it)
BLOCK = 1 << 20  # weights dequantized per GEMM call above LOOP_ROWS: a 4 MB scratch buffer, cache-sized


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    rows, in_features = stop - start, weight.shape[1]
    groups = scale.shape[1] if scale.dim() == 2 else 1
    buffer = native.scratch.scratch("weight_only", rows * in_features, torch.float32)
    torch.mul(weight[start:stop].view(rows, groups, in_features // groups), scale[start:stop].view(rows, groups, 1),
              out=buffer.view(rows, groups, in_features // groups))
    return buffer.view(rows, in_features)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, *,
                       input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x * input_scale`` (``x`` alone without SmoothQuant's float32 ``input_scale``, one per input), ``x`` (...,
    in_features) float, times dense int8 ``weight`` (out_features, in_features), each weight times its float32
    ``scale`` (one per output channel, 1-d, or per group of inputs of each output, (out_features, groups)), plus
    float32 ``bias``; float in, float out. The C loop multiplies by ``input_scale`` itself; the GEMM path first."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"weight_only_linear: input of shape {tuple(x.shape)} for {in_features} input features")
    if x.dtype == torch.float32 and x.numel() <= LOOP_ROWS * in_features and x.is_contiguous():
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        if weight_only_into(out, x, weight, scale, bias, input_scale):
            return out  # a decode step: one call, on the input as it lies
    rows = x.reshape(-1, in_features).to(torch.float32)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0] > LOOP_ROWS or not weight_only_into(out, rows, weight, scale, bias, input_scale):
        if input_scale is not None:
            rows = rows * input_scale
        step = max(1, BLOCK // in_features)
        for start in range(0, out_features, step):
            stop = min(start + step, out_features)
            part = F.linear(rows, _dequantized(weight, scale, start, stop),
                            None if bias is None else bias[start:stop])
            if stop - start == out_features:
                out = part
            else:
                out[:, start:stop] = part
    return out.reshape(*x.shape[:-1], out_features).to(x.dtype)

"""Dynamic per-group INT8 Linear (``QuantConfig(scheme="dynamic_group")``): W8A8 with one activation scale per
:data:`GROUP` consecutive inputs of each row.

Each group of each input row is quantized at run time, symmetrically to [-127, 127] with its own scale
``max|x_group| / 127``; the weights are int8 with one scale per output channel. The int32 sums of one group's
products are exact; they are rescaled by their group's scale and added in float32, group by group in order, then
times the weight scale plus the bias. Per-token scales (:mod:`fxquant.kernels.per_token`) give a row one scale,
sized by its largest value: a transformer's few outlier channels (after its norms, and in the product that feeds
an LLM's ``down_proj``) leave every other input of that row a handful of levels. A group's outliers cost only that
group (docs/quantization.md "Schemes" measures both on SmolLM2). The weights' layout is the kernel's
(:func:`pack_weights`); their bytes are those of the per-token scheme.

One C call (``fxquant/native/csrc/int8_groups.c``, AVX512-VNNI) quantizes, sums and rescales any number of rows on
weights packed for it (:func:`pack_weights`); elsewhere float32 GEMMs per group compute the same exact sums and the
same float steps: the same bytes either way, at any number of rows (a row's outputs do not depend on the rows
beside it) and threads.
"""

from __future__ import annotations

import torch

from fxquant.kernels.per_token import quantize_rows
from fxquant.native.per_group import int8_groups_into

GROUP = 128  # inputs per activation scale (docs/quantization.md "Schemes" measures 64, 128 and 256 on SmolLM2)
PAD = 32  # outputs are packed in blocks of this many (int8_groups.c: two 16-lane blocks per tile)
_CHUNK = 16  # groups per batched float GEMM of the torch path: its scratch is 16 x rows x out_features floats


def group_size(in_features: int) -> int | None:
    """The inputs per activation scale of a Linear with ``in_features`` inputs: :data:`GROUP` where it divides them,
    else the largest power of two below it that does and is a multiple of 4 (the C loop reads four inputs at a
    time); None where ``in_features`` is not a multiple of 4."""
    group = GROUP
    while group >= 4 and in_features % group:
        group //= 2
    return group if group >= 4 else None


def pack_weights(qweight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, group_sums)`` of int8 ``qweight`` (out_features, in_features), ``group`` dividing in_features and
    a multiple of 4: ``packed`` (n_pad / PAD, in_features / 4, PAD, 4) int8 holds each block of :data:`PAD` outputs
    together, four consecutive inputs of one output side by side (n_pad: out_features rounded up to PAD, zero
    beyond), so a block's weights are read in one run; ``group_sums`` (groups, n_pad) int32 is
    128 times the sum of each group's weights of each output (the C loop's unsigned offset)."""
    out_features, in_features = qweight.shape
    if group % 4 or in_features % group:
        raise ValueError(f"pack_weights: group {group} must be a multiple of 4 dividing {in_features} inputs")
    n_pad = -(-out_features // PAD) * PAD
    padded = torch.zeros(n_pad, in_features, dtype=torch.int8)
    padded[:out_features] = qweight
    packed = padded.view(n_pad // PAD, PAD, in_features // 4, 4).transpose(1, 2).contiguous()
    sums = padded.view(n_pad, in_features // group, group).sum(dim=2, dtype=torch.int32).t().contiguous()
    return packed, sums.mul_(128)


def unpack_weights(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The int8 (out_features, in_features) weight :func:`pack_weights` packed."""
    blocks, quads = packed.shape[:2]
    return packed.transpose(1, 2).reshape(blocks * PAD, quads * 4)[:out_features].contiguous()


def packed_rows(packed: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """The int8 weights of the outputs ``outputs`` (1-d indices) from :func:`pack_weights`' layout, without
    unpacking the rest: (len(outputs), in_features)."""
    rows = packed[torch.div(outputs, PAD, rounding_mode="floor"), :, outputs % PAD]  # (len(outputs), in / 4, 4)
    return rows.reshape(outputs.shape[0], packed.shape[1] * 4)


def quantize_groups(rows: torch.Tensor, group: int,
                    input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of 2-d float32 ``rows`` (times ``input_scale`` per column where given), one scale per
    ``group`` consecutive values of each row: ``(q, scale)``, q of rows' shape, scale (rows, groups)."""
    if input_scale is not None:
        rows = rows * input_scale
    count, width = rows.shape
    q, scale = quantize_rows(rows.reshape(count * (width // group), group))
    return q.view(count, width), scale.view(count, width // group)


def _torch_path(rows: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                group: int, input_scale: torch.Tensor | None) -> torch.Tensor:
    q, scale = quantize_groups(rows, group, input_scale)
    count, groups, out_features = rows.shape[0], rows.shape[1] // group, qweight.shape[0]
    q_groups = q.view(count, groups, group).transpose(0, 1)
    w_groups = qweight.view(out_features, groups, group).permute(1, 2, 0)
    out = torch.zeros(count, out_features, dtype=torch.float32)
    for start in range(0, groups, _CHUNK):  # a bounded scratch; the groups still summed one by one, in order
        stop = min(start + _CHUNK, groups)
        # exact: every partial sum is an integer below 127 * 128 * GROUP < 2**24
        sums = torch.bmm(q_groups[start:stop].to(torch.float32), w_groups[start:stop].to(torch.float32))
        for g in range(start, stop):
            out.add_(sums[g - start].mul_(scale[:, g:g + 1]))
    out.mul_(weight_scale)
    return out if bias is None else out.add_(bias)


def per_group_linear(x: torch.Tensor, packed: torch.Tensor, group_sums: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, *, out_features: int, group: int = GROUP,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x * input_scale`` (``x`` alone without SmoothQuant's float32 ``input_scale``, one per input), ``x`` (...,
    in_features) float, times the int8 weights :func:`pack_weights` packed (with their ``group_sums``) with float32
    per-output ``weight_scale``, plus float32 ``bias``; float in, float out."""
    in_features = packed.shape[1] * 4
    if x.shape[-1] != in_features:
        raise ValueError(f"per_group_linear: input of shape {tuple(x.shape)} for {in_features} input features")
    if x.dtype == torch.float32 and x.is_contiguous():
        rows = x  # a decode step's input, read as it lies, the output made in its final shape
    else:
        rows = x.reshape(-1, in_features).to(torch.float32)
        if rows.stride(-1) != 1 or rows.stride(0) < in_features:
            rows = rows.contiguous()
    out = torch.empty((*rows.shape[:-1], out_features), dtype=torch.float32)
    if not int8_groups_into(out, rows, packed, group_sums, weight_scale, bias, input_scale, group):
        weight = unpack_weights(packed, out_features)
        out = _torch_path(rows.reshape(-1, in_features), weight, weight_scale, bias, group, input_scale).view(out.shape)
    return out if rows is x else out.reshape(*x.shape[:-1], out_features).to(x.dtype)

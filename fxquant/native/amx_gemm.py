"""Typed wrappers of the int8 GEMM loops (``fxquant/native/csrc/amx_gemm.c``, ``rows_avx2.c`` and ``patches.c``):
convs, few-row Linears and kernel == stride transposed convs, each computing the bytes fbgemm's or qnnpack's kernel
computes, on AVX512-VNNI and AMX tiles (few-row Linears also on AVX2 alone). Which layers take them, and why:
docs/amx.md; the packing: ``fxquant/kernels/torch_engines``.

Each wrapper returns False (nothing written) where this process cannot run its loop, and the caller keeps the
engine's kernel. The records below are the C structs, one tuple each, fields in order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxquant.native import loader
from fxquant.native.elementwise import ByteRows
from fxquant.native.loader import extension

Triple = tuple[int, int, int]
Quad = tuple[int, int, int, int]


class GemmWeights(NamedTuple):
    """C ``GemmWeights``: packed int8 weights and per-output-channel terms (addresses), then the sizes."""

    w: int
    colsum: int
    int_bias: int
    bias: int
    multipliers: int
    in_channels: int
    n_pad: int
    out_channels: int


class Requant(NamedTuple):
    """C ``Requant``: input and output zero points, a fused ReLU, and the top of the output's range (255, or 127
    for 7-bit activations, whose layers the engine's op would leave to one more clamp): outputs saturate to
    ``[zo if relu else 0, qmax]``."""

    zx: int
    zo: int
    relu: bool
    qmax: int


class OnednnRequant(NamedTuple):
    """C ``OnednnRequant``: oneDNN's requantization of a Linear's sums, ``f = float(sum - zx * colsum) * mult +
    bias`` (max(f, 0) with ``relu``), kept as float32 with ``float_out``, else ``rint(f * dst_inv + zo)`` saturated
    to ``[0, qmax]``."""

    zx: int
    zo: int
    relu: bool
    float_out: bool
    qmax: int
    dst_inv: float


class ConvInput(NamedTuple):
    """C ``ConvInput``: (N, D, H, W, C) bytes; strides of (N, D, H, W) in bytes, channels at stride 1."""

    data: int
    dims: tuple[int, int, int, int, int]
    strides: Quad


class ConvWindow(NamedTuple):
    """C ``ConvWindow``: over (depth, height, width)."""

    kernel: Triple
    stride: Triple
    padding: Triple


class ConvOutput(NamedTuple):
    """C ``ConvOutput``: (N, Do, Ho, Wo, C_out) bytes; ``size`` (Do, Ho, Wo), strides of (N, Do, Ho, Wo)."""

    data: int
    size: Triple
    strides: Quad


class PatchInput(NamedTuple):
    """C ``PatchInput``: (N, H, W, K) bytes; strides of (N, H, W) in bytes, channels at stride 1."""

    data: int
    dims: Triple
    strides: Triple


class PatchWeights(NamedTuple):
    """C ``PatchWeights``: (ceil(K / 4), n_pad, 4) int8 weights, colsum and float bias (addresses), then sizes."""

    w: int
    colsum: int
    bias: int
    in_channels: int
    n_pad: int
    out_channels: int


class PatchRequant(NamedTuple):
    """C ``PatchRequant``: fbgemm's float-bias requantization, ``fma(bias, rcp, acc) * multiplier``."""

    rcp: float
    multiplier: float
    zx: int
    zo: int


class PatchOutput(NamedTuple):
    """C ``PatchOutput``: (N, OH, OW, C_out) bytes; strides of (N, OH, OW) in bytes."""

    data: int
    strides: Triple


Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # int32 bias, float bias, multiplier per channel


def gemm_weights(weight: torch.Tensor, column_sums: torch.Tensor, factors: Factors,
                 sizes: Triple) -> GemmWeights:
    """``sizes``: in_channels, n_pad, out_channels."""
    int_bias, bias, multipliers = factors
    return GemmWeights(weight.data_ptr(), column_sums.data_ptr(), int_bias.data_ptr(), bias.data_ptr(),
                       multipliers.data_ptr(), *sizes)


def patches_into(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, column_sums: torch.Tensor,
                 bias: torch.Tensor, out_channels: int, factors: tuple[float, float], zero_points: tuple[int, int],
                 kernel: tuple[int, int]) -> bool:
    """A transposed conv with kernel == stride, as fbgemm's Linear computes it, written in place (``patches_u8``):
    ``a`` (N, C_in, H, W) and ``out`` (N, C_out, H * kh, W * kw), both with channels at stride 1 (3-d tensors: a
    1-d conv, ``kernel`` (1, k)); ``factors``: (1 / (s_x * s_w), multiplier). False where the CPU lacks
    AVX512-VNNI."""
    assert loader.loops is not None and (a.stride(1) == 1 or a.shape[1] == 1) and out.stride(1) == 1
    if a.dim() == 3:  # a 1-d conv: one row of height 1
        dims, a_strides, out_strides = (a.shape[0], 1, a.shape[2]), (a.stride(0), 0, a.stride(2)), \
            (out.stride(0), 0, out.stride(2))
    else:
        dims, a_strides, out_strides = (a.shape[0], a.shape[2], a.shape[3]), (a.stride(0), a.stride(2), a.stride(3)), \
            (out.stride(0), out.stride(2), out.stride(3))
    weights = PatchWeights(weight.data_ptr(), column_sums.data_ptr(), bias.data_ptr(), a.shape[1], weight.shape[1],
                           out_channels)
    requant = PatchRequant(*factors, *zero_points)
    return extension.patches_u8(PatchInput(a.data_ptr(), dims, a_strides), weights, requant,
                                PatchOutput(out.data_ptr(), out_strides), kernel)


def conv_into(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, column_sums: torch.Tensor, factors: Factors,
              out_channels: int, geometry: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]],
              requant: Requant) -> bool:
    """A 1-, 2- or 3-d conv as fbgemm or qnnpack computes it, on AMX tiles (``conv_u8``): ``a`` (N, C, *size) and
    ``out`` (N, C_out, *out_size) with channels at stride 1; ``factors``: int32 bias, float bias and multiplier per
    channel; ``geometry``: kernel, stride and padding, one entry per spatial dimension; ``requant``: zero points,
    ReLU and the output range's top. False where the process cannot use AMX (nothing written)."""
    assert loader.loops is not None and (a.stride(1) == 1 or a.shape[1] == 1) and out.stride(1) == 1
    missing = 5 - a.dim()  # as (N, D, H, W, C): a 2-d conv has depth 1, a 1-d conv height 1 too

    def full(values: tuple[int, ...], fill: int) -> Triple:
        padded = (fill,) * missing + tuple(values)
        return padded[0], padded[1], padded[2]

    kernel, stride, padding = (full(v, f) for v, f in zip(geometry, (1, 1, 0), strict=True))
    size, x_strides = full(a.shape[2:], 1), full(a.stride()[2:], 0)
    out_size, out_strides = full(out.shape[2:], 1), full(out.stride()[2:], 0)
    x = ConvInput(a.data_ptr(), (a.shape[0], *size, a.shape[1]), (a.stride(0), *x_strides))
    weights = gemm_weights(weight, column_sums, factors, (a.shape[1], weight.shape[1], out_channels))
    return extension.conv_u8(x, ConvWindow(kernel, stride, padding), weights, requant,
                             ConvOutput(out.data_ptr(), out_size, (out.stride(0), *out_strides)))


def linear_rows_into(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, column_sums: torch.Tensor,
                     factors: Factors, out_channels: int, requant: Requant) -> bool:
    """A Linear on the rows of ``a`` (rows, C) into ``out`` (rows, C_out), both with unit column stride, with the
    conv loop's requantization and ``weight`` blocked by 64 channels (``NativeConv.row_weight``), by AVX512-VNNI
    (``linear_rows_u8``: for a few rows, where 16-row AMX tiles would be mostly empty), else by AVX2, which sums
    pairs of products in 16 bits as fbgemm's AVX2 kernel does (exact on 7-bit inputs). False where the CPU lacks
    AVX2 (nothing written)."""
    assert loader.loops is not None and a.dim() == 2 and out.dim() == 2 and (a.stride(1) == 1 or a.shape[1] == 1)
    weights = gemm_weights(weight, column_sums, factors, (a.shape[1], column_sums.shape[0], out_channels))
    return extension.linear_rows_u8(ByteRows(a.data_ptr(), a.stride(0)), a.shape[0], weights,
                                    requant, ByteRows(out.data_ptr(), out.stride(0)))


def rows_layout(weight: torch.Tensor) -> torch.Tensor:
    """A Linear's int8 ``weight`` (C_out, C_in) in the row loops' layout, (ceil(C_out / 64), ceil(C_in / 4), 64, 4):
    each 64-channel block's bytes in reading order, zeros past the weight."""
    out_channels, in_channels = weight.shape
    wide = weight.new_zeros(-(-out_channels // 64) * 64, -(-in_channels // 4) * 4)
    wide[:out_channels, :in_channels] = weight
    return wide.reshape(-1, 64, wide.shape[1] // 4, 4).transpose(1, 2).contiguous()


def rows_of_layout(layout: torch.Tensor, outputs: torch.Tensor, in_channels: int) -> torch.Tensor:
    """The plain int8 rows ``outputs`` (1-d indices) of a weight in :func:`rows_layout`'s layout (a new tensor)."""
    picked = layout[outputs.div(64, rounding_mode="floor"), :, outputs % 64, :]  # (len(outputs), C_in / 4, 4)
    return picked.reshape(len(outputs), layout.shape[1] * 4)[:, :in_channels].contiguous()


class OnednnRows:
    """``linear_rows_onednn`` on ``rows`` rows as ``run(x address, out address)``: the AVX2 row loop's sums with
    oneDNN's requantization, exact on 7-bit inputs; RuntimeError (nothing written) without AVX2. It holds the
    tensors whose addresses it passes, so a replay that keeps only ``run`` keeps them. ``strides``: of the input and
    output rows, in bytes; ``weight`` in :func:`rows_layout`'s layout, the other terms padded to its channels."""

    def __init__(self, rows: int, strides: tuple[int, int], weight: torch.Tensor, column_sums: torch.Tensor,
                 factors: Factors, sizes: tuple[int, int], requant: OnednnRequant) -> None:
        """``sizes``: in_channels, out_channels."""
        assert loader.loops is not None
        self.tensors = (weight, column_sums, *factors)
        self.strides = strides
        self.args = (rows, gemm_weights(weight, column_sums, factors, (sizes[0], column_sums.shape[0], sizes[1])),
                     requant)
        self.entry = extension.linear_rows_onednn

    def __call__(self, x: int, out: int) -> None:
        rows, weights, requant = self.args
        if not self.entry(ByteRows(x, self.strides[0]), rows, weights, requant, ByteRows(out, self.strides[1])):
            raise RuntimeError("linear_rows_onednn: this CPU has no AVX2 (the caller checks isa.has_avx2 first)")


def padded(values: torch.Tensor, size: int) -> torch.Tensor:
    """``values`` followed by zeros, ``size`` in all (the padding channels the loops sum and never store)."""
    out = torch.zeros(size, dtype=values.dtype)
    out[:values.numel()] = values.reshape(-1)
    return out

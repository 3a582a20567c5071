"""Transposed convs on fbgemm/qnnpack without fbgemm's broken direct kernel.

fbgemm's direct transposed-conv kernel is wrong in torch 2.13: it writes input row ``i`` to output row ``i`` instead
of ``i * stride`` and mixes the images of a batch (most outputs off by many steps; pinned in
``tests/kernels/test_fbgemm_qnnpack_pitfalls.py``). fxquant never reaches it:

* a transposed conv whose kernel equals its stride writes one separate kernel-sized patch per input position, so it
  runs as a Linear (C_in -> kernel * C_out) then depth-to-space (U-Net upsamplers). On fbgemm with AVX512-VNNI the
  C loop ``patches_u8`` (in :mod:`fxquant.native`) computes exactly what fbgemm's Linear computes and writes each
  patch in place, with no depth-to-space copy (:func:`run_patches`; measured in docs/amx.md);
* any other conv that would take the direct path gets one zero output channel more, which steers fbgemm to its
  correct im2col kernel; the extra channel is dropped from the output.

This module decides the path, lays out weights and outputs and runs the patch loop; the engines' kernels are called
in :mod:`fxquant.kernels.torch_engines.backends`, and the quantized tensors are made in
:mod:`fxquant.kernels.torch_engines.engine`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from fxquant import native
from fxquant.kernels.base import ConvSpec
from fxquant.kernels.torch_engines.engine import empty_quantized, grid, is_quint8


@dataclass(frozen=True)
class Transposed:
    """A packed transposed conv. ``patches``: run as a Linear to one kernel-sized output patch per input position
    (``kernel`` == stride, no padding), ``keep`` output channels of a kernel packed with extra zero channels."""

    dim: int
    packed: Any
    patches: tuple[int, ...] = ()
    keep: int = 0
    native: NativePatches | None = None


@dataclass(frozen=True)
class NativePatches:
    """The patch Linear's weight for the C loop: ``weight`` (ceil(C_in / 4), n_pad, 4) int8 with four consecutive
    inputs of one output column together, zeros beyond C_in and beyond the real columns (``n_pad`` a multiple of 16);
    per-column weight sums (the input zero point's share) and the float bias, zero-padded to ``n_pad``."""

    weight: torch.Tensor
    column_sums: torch.Tensor
    bias: torch.Tensor
    weight_scale: float
    out_channels: int

    MAX_COLUMNS = 2048  # the C loop's row buffer


def native_patches(rows: torch.Tensor, bias: torch.Tensor | None, weight_scale: float,
                   out_channels: int) -> NativePatches | None:
    """Lay out the patch Linear's int8 ``rows`` (``(kernel * C_out, C_in)``, zero point 0) for the C loop, or None
    where it does not fit its buffer."""
    columns, inputs = rows.shape
    n_pad, k4 = -(-columns // 16) * 16, -(-inputs // 4)
    if n_pad > NativePatches.MAX_COLUMNS:
        return None
    padded = rows.new_zeros(n_pad, 4 * k4)
    padded[:columns, :inputs] = rows
    sums = torch.zeros(n_pad, dtype=torch.int32)
    sums[:columns] = rows.sum(1, dtype=torch.int32)
    padded_bias = torch.zeros(n_pad)
    if bias is not None:
        padded_bias[:columns] = bias
    return NativePatches(padded.reshape(n_pad, k4, 4).transpose(0, 1).contiguous(), sums, padded_bias,
                         weight_scale, out_channels)


def direct_conv_path(weight: torch.Tensor, spec: ConvSpec) -> bool:
    """Whether fbgemm runs this transposed conv with its broken direct kernel. Its condition (fbgemm's
    ``takeDirectConvPath``, matched case by case in ``tests/kernels/test_fbgemm_qnnpack_pitfalls.py``): 2-d, groups 1,
    input and output channels multiples of 8, kernel height 2 and width <= 6, strides 1 or 2, no padding,
    dilation 1."""
    kernel = weight.shape[2:]
    return (spec.dim == 2 and spec.groups == 1 and weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0
            and kernel[0] == 2 and kernel[1] <= 6 and all(s in (1, 2) for s in spec.stride)
            and not any(spec.padding) and all(d == 1 for d in spec.dilation))


def with_zero_channel(weight: torch.Tensor,
                      bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``weight`` and ``bias`` with one zero output channel more (off fbgemm's direct path), and how many to keep."""
    keep = weight.shape[1]
    weight = torch.cat([weight, weight.new_zeros(weight.shape[0], 1, *weight.shape[2:])], 1)
    bias = None if bias is None else torch.cat([bias.detach().float(), bias.new_zeros(1)])
    return weight, bias, keep


def as_patches(weight: torch.Tensor, spec: ConvSpec) -> bool:
    """Whether the transposed conv writes one separate kernel-sized patch per input position (kernel == stride, no
    padding, groups 1, dilation 1), so it can run as a Linear then depth-to-space."""
    return (tuple(weight.shape[2:]) == spec.stride and spec.groups == 1 and not any(spec.padding)
            and not any(spec.output_padding) and all(d == 1 for d in spec.dilation))


def patch_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                 spec: ConvSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Linear's ``(kernel * C_out, C_in)`` weight, output rows in patch order, and its bias (one per row)."""
    patches = weight.movedim(0, -1).movedim(0, -2)  # (*kernel, C_out, C_in)
    tiled = None if bias is None else bias.detach().float().repeat(math.prod(spec.stride))
    return patches.reshape(-1, weight.shape[0]), tiled


def requantize_factors(in_scale: float, weight_scale: float, out_scale: float) -> tuple[float, float]:
    """fbgemm's float-bias requantization constants, rounded as its Linear rounds them: the bias is multiplied by
    ``1 / (s_x * s_w)`` (a double reciprocal of the float product), the sum by ``(s_x * s_w) / s_out`` in float."""
    product = _float32(_float32(in_scale) * _float32(weight_scale))
    return _float32(1.0 / product), _float32(product / _float32(out_scale))


def _float32(value: float) -> float:
    """``value`` rounded to float32 (a float32 product or quotient of float32 values, computed in double and rounded
    once, is the correctly rounded float32 result)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def depth_to_space(out: torch.Tensor, a: torch.Tensor, t: Transposed) -> torch.Tensor:
    """``out``, the Linear over the channels of ``a`` (``(N, *size, prod(kernel) * C_out)``; a channels-last ``a``
    needs no copy for it), with the patches put in place, channels-last."""
    n, size, channels = a.shape[0], a.shape[2:], out.shape[-1] // math.prod(t.patches)
    if t.dim == 1:
        return out.reshape(n, size[0] * t.patches[0], channels).movedim(-1, 1)
    out = out.reshape(n, size[0], size[1], t.patches[0], t.patches[1], channels).transpose(2, 3)
    return out.reshape(n, size[0] * t.patches[0], size[1] * t.patches[1], channels).movedim(-1, 1)


def run_patches(a: torch.Tensor, t: Transposed, scale: float, zp: int) -> torch.Tensor | None:
    """The upsampler by the C loop (fbgemm's Linear's results, written in place), or None: no loop for this layer or
    a traced export (it records fbgemm's Linear). An input with strided channels is made channels-last first, as
    the Linear would."""
    loop = t.native
    if loop is None or not native.available("upsample") or torch.jit.is_tracing() or not is_quint8(a):
        return None
    if a.stride(1) != 1 and a.shape[1] > 1:
        a = a.movedim(1, -1).contiguous().movedim(-1, 1)
    n, size = a.shape[0], [s * k for s, k in zip(a.shape[2:], t.patches, strict=True)]
    if t.dim == 1:
        out = empty_quantized([n, size[0], loop.out_channels], scale, zp).movedim(-1, 1)
    else:
        out = empty_quantized([n, loop.out_channels, *size], scale, zp, memory_format=torch.channels_last)
    in_scale, in_zp = grid(a)
    factors = requantize_factors(in_scale, loop.weight_scale, scale)
    kernel = (1, t.patches[0]) if t.dim == 1 else t.patches
    done = native.patches_into(out, a, loop.weight, loop.column_sums, loop.bias, loop.out_channels, factors,
                               (in_zp, zp), (kernel[0], kernel[1]))
    return out if done else None

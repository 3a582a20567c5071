"""The optional C loops (``fxquant/native/_native.c``), or None when fxquant was installed without a C compiler or the
environment sets ``FXQUANT_NATIVE=0``.

Every caller keeps a torch path with the same results: the loops are speed, never semantics.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from fxquant.native.isa import isa_cap

DISABLE_ENV = "FXQUANT_NATIVE"  # "0": the torch (and engine) paths everywhere, e.g. to compare or to debug

loops: ModuleType | None
try:
    from fxquant.native import _native as loops
except ImportError:  # no compiler at install time: the torch paths
    loops = None
if os.environ.get(DISABLE_ENV) == "0":
    loops = None
if loops is not None:
    loops.set_isa_cap(isa_cap(strict=False))  # FXQUANT_ISA, read once: the loops keep the process's first cap


# The thread rule. Every loop here runs on one thread, while the kernels they replace (fbgemm's, qnnpack's, torch's
# element-wise ops) split their work across torch's intra-op threads. So each family runs only up to the largest
# torch thread count at which it was measured faster than what it replaces, and yields to that kernel above it, at
# any thread count (docs/amx.md "Threads", which gives the measurements; scripts/bench_amx_layers.py --threads N).
THREAD_LIMITS = {"conv": 2, "fbgemm_linear": 1, "qnnpack_linear": 2, "upsample": 1, "elementwise": 2, "histogram": 4}


def loops_for(family: str = "elementwise") -> ModuleType | None:
    """The C loops where they are here and ``family``'s (:data:`THREAD_LIMITS`) may run at torch's current thread
    count, else None."""
    return loops if loops is not None and torch.get_num_threads() <= THREAD_LIMITS[family] else None


def available(family: str = "elementwise") -> bool:
    return loops_for(family) is not None


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def dense_format(a: torch.Tensor) -> torch.memory_format | None:
    """The memory format in which ``a``'s elements fill its memory in order (a byte loop can then read it flat), or
    None for other strides (slices, transposes)."""
    if a.is_contiguous():
        return torch.contiguous_format
    channels_last = _CHANNELS_LAST.get(a.dim())
    return channels_last if channels_last is not None and a.is_contiguous(memory_format=channels_last) else None


def concat(values: Sequence[torch.Tensor], dim: int,
           empty: Callable[[list[int]], torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(values, dim)`` of one-byte activations by row copies (``_native.c``'s ``copy_rows``), or None
    (nothing done) where the loops are missing, a trace records the torch op, or the layouts are not row-major or
    channels-last with ``dim`` the channels. ``empty(shape)``: a contiguous output of the inputs' kind (quantized
    dtypes carry their scale). torch's cat interleaves channels-last inputs one element at a time: 3-5x slower on
    U-Net's skip concats."""
    first = values[0] if values else None
    if loops is None or not available() or first is None or torch.jit.is_tracing() or first.element_size() != 1:
        return None
    if any(v.dtype != first.dtype or v.dim() != first.dim() for v in values):
        return None
    dim %= first.dim()
    channels_last = dim == 1 and first.dim() >= 3 and all(v.stride(1) == 1 or v.shape[1] == 1 for v in values)
    views = [v.movedim(1, -1) for v in values] if channels_last else list(values)
    axis = first.dim() - 1 if channels_last else dim
    shape = list(views[0].shape)
    if any(not v.is_contiguous() or list(v.shape[:axis] + v.shape[axis + 1:]) != shape[:axis] + shape[axis + 1:]
           for v in views):
        return None
    shape[axis] = sum(v.shape[axis] for v in views)
    out = empty(shape)
    rows, out_width, offset = math.prod(shape[:axis]), math.prod(shape[axis:]), 0
    for v in views:
        width = math.prod(v.shape[axis:])
        loops.copy_rows(v.data_ptr(), width, out.data_ptr() + offset, out_width, rows, width)
        offset += width
    return out.movedim(-1, 1) if channels_last else out


def lookup_into(out: torch.Tensor, a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``out[i] = table[a[i]]`` over the raw bytes of ``a`` and ``out`` (same shape and dense format; uint8, int8 or
    quint8 storage), by the C loop; the caller checks that ``loops`` is there."""
    assert loops is not None and out.shape == a.shape and table.numel() == 256 and table.dtype == torch.uint8
    loops.lookup_u8(a.data_ptr(), out.data_ptr(), a.numel(), table.data_ptr())
    return out


def patches_into(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, column_sums: torch.Tensor,
                 bias: torch.Tensor, out_channels: int, factors: tuple[float, float], zero_points: tuple[int, int],
                 kernel: tuple[int, int]) -> bool:
    """A transposed conv with kernel == stride, as fbgemm's Linear computes it, written in place
    (``_native.c``'s ``patches_u8``): ``a`` (N, C_in, H, W) and ``out`` (N, C_out, H * kh, W * kw), both with
    channels at stride 1 (3-d tensors: a 1-d conv, ``kernel`` (1, k)). False where the CPU lacks AVX512-VNNI."""
    assert loops is not None and (a.stride(1) == 1 or a.shape[1] == 1) and out.stride(1) == 1
    if a.dim() == 3:  # a 1-d conv: one row of height 1
        dims, a_strides, out_strides = (a.shape[0], 1, a.shape[2]), (a.stride(0), 0, a.stride(2)), \
            (out.stride(0), 0, out.stride(2))
    else:
        dims, a_strides, out_strides = (a.shape[0], a.shape[2], a.shape[3]), (a.stride(0), a.stride(2), a.stride(3)), \
            (out.stride(0), out.stride(2), out.stride(3))
    return bool(loops.patches_u8(a.data_ptr(), dims, a_strides, a.shape[1], weight.data_ptr(),
                                 column_sums.data_ptr(), bias.data_ptr(), weight.shape[1], out_channels, *factors,
                                 *zero_points, out.data_ptr(), out_strides, kernel))


def conv_into(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, column_sums: torch.Tensor,
              factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out_channels: int,
              geometry: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], zero_points: tuple[int, int],
              relu: bool) -> bool:
    """A 1-, 2- or 3-d conv as fbgemm or qnnpack computes it, on AMX tiles (``_native.c``'s ``conv_u8``): ``a``
    (N, C, *size) and ``out`` (N, C_out, *out_size) with channels at stride 1; ``factors``: int32 bias, float bias
    and multiplier per channel; ``geometry``: kernel, stride and padding, one entry per spatial dimension. False
    where the process cannot use AMX (nothing written)."""
    assert loops is not None and (a.stride(1) == 1 or a.shape[1] == 1) and out.stride(1) == 1
    missing = 5 - a.dim()  # as (N, D, H, W, C): a 2-d conv has depth 1, a 1-d conv height 1 too

    def full(values: tuple[int, ...], fill: int) -> tuple[int, int, int]:
        padded = (fill,) * missing + tuple(values)
        return padded[0], padded[1], padded[2]

    kernel, stride, padding = (full(v, f) for v, f in zip(geometry, (1, 1, 0), strict=True))
    size, x_strides = full(a.shape[2:], 1), full(a.stride()[2:], 0)
    out_size, out_strides = full(out.shape[2:], 1), full(out.stride()[2:], 0)
    int_bias, bias, multipliers = factors
    return bool(loops.conv_u8(a.data_ptr(), (a.shape[0], *size, a.shape[1]), (a.stride(0), *x_strides), kernel,
                              stride, padding, weight.data_ptr(), column_sums.data_ptr(), int_bias.data_ptr(),
                              bias.data_ptr(), multipliers.data_ptr(), a.shape[1], weight.shape[1], out_channels,
                              *zero_points, relu, out.data_ptr(), out_size, (out.stride(0), *out_strides)))


def linear_rows_into(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, column_sums: torch.Tensor,
                     factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out_channels: int,
                     zero_points: tuple[int, int], relu: bool) -> bool:
    """A Linear on the rows of ``a`` (rows, C) into ``out`` (rows, C_out), both with unit column stride, with the
    conv loop's requantization and ``weight`` blocked by 64 channels (``NativeConv.row_weight``), by AVX512-VNNI
    (``_native.c``'s ``linear_rows_u8``: for a few rows, where 16-row AMX tiles would be mostly empty). False where
    the CPU lacks VNNI (nothing written)."""
    assert loops is not None and a.dim() == 2 and out.dim() == 2 and (a.stride(1) == 1 or a.shape[1] == 1)
    int_bias, bias, multipliers = factors
    return bool(loops.linear_rows_u8(a.data_ptr(), a.shape[0], a.stride(0), a.shape[1], weight.data_ptr(),
                                     column_sums.data_ptr(), int_bias.data_ptr(), bias.data_ptr(),
                                     multipliers.data_ptr(), column_sums.shape[0], out_channels, *zero_points, relu,
                                     out.data_ptr(), out.stride(0)))

"""Typed wrappers of the element-wise C loops (``fxquant/native/csrc/elementwise.c``), one per entry point, and the
layout test their callers share.

Each wrapper takes tensors and the records below (one per C struct, its fields in order: the C side parses each as
one tuple), writes into ``out`` and returns it. The caller checks first that the loops may run
(:func:`~fxquant.native.loader.loops_for`); the asserts are the callers' invariants, not input checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fxquant.native import loader
from fxquant.native.loader import extension

Triple = tuple[int, int, int]


class Planes(NamedTuple):
    """C ``Planes``: a tensor walked as (outer, channels, inner); NCHW has outer N and inner H * W."""

    outer: int
    channels: int
    inner: int


class QuantizeParams(NamedTuple):
    """C ``QuantizeParams``: ``q = clamp(round(x / scale) + zero_point, qmin, qmax)``."""

    scale: float
    zero_point: int
    qmin: int
    qmax: int


class ByteLevels(NamedTuple):
    """C ``ByteLevels``: a uint8 grid's zero point and the range results are clamped to."""

    zero_point: int
    qmin: int
    qmax: int


class MulLayout(NamedTuple):
    """Three uint8 tensors walked as ``shape`` (n, rows, length): the element strides of each (0 where ``b`` is
    broadcast), the dimension with the smallest strides last."""

    shape: Triple
    a: Triple
    b: Triple
    out: Triple


class Bytes3(NamedTuple):
    """C ``Bytes3``: a uint8 tensor at ``data`` walked as three dimensions, their element strides."""

    data: int
    strides: Triple


class MulRequant(NamedTuple):
    """C ``MulRequant``: ``out = clamp(rint((a - za) * ((b - zb) * factor)) + zo, qmin, qmax)``, rounded in float32,
    or float64 where ``wide``."""

    za: int
    zb: int
    zo: int
    qmin: int
    qmax: int
    factor: float
    wide: bool


class ByteRows(NamedTuple):
    """C ``ByteRows``: rows of bytes at ``data``, ``stride`` bytes apart."""

    data: int
    stride: int


class PoolShape(NamedTuple):
    """C ``PoolShape``: a dense channels-last uint8 input (batch, height, width, channels) and its output's size."""

    batch: int
    height: int
    width: int
    channels: int
    out_h: int
    out_w: int


class PoolWindow(NamedTuple):
    """C ``PoolWindow``: a 2-d pooling window's size, stride, padding and dilation, (height, width) each."""

    kernel_h: int
    kernel_w: int
    stride_h: int
    stride_w: int
    pad_h: int
    pad_w: int
    dilation_h: int
    dilation_w: int


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def dense_format(a: torch.Tensor) -> torch.memory_format | None:
    """The memory format in which ``a``'s elements fill its memory in order (a byte loop can then read it flat), or
    None for other strides (slices, transposes)."""
    if a.is_contiguous():
        return torch.contiguous_format
    channels_last = _CHANNELS_LAST.get(a.dim())
    return channels_last if channels_last is not None and a.is_contiguous(memory_format=channels_last) else None


def quantize_call(shape: Sequence[int], params: QuantizeParams, *, to_nhwc: bool) -> Callable[[int, int], None]:
    """``quantize_f32`` for a dense float32 tensor of ``shape``, as ``run(x address, out address)`` (what
    :func:`quantize_into` calls; a replay repeats it on other buffers of the same layouts)."""
    outer, channels = (shape[0], shape[1]) if to_nhwc else (1, 1)
    planes = Planes(outer, channels, math.prod(shape) // max(outer * channels, 1))
    quantize_f32 = extension.quantize_f32
    return lambda x, out: quantize_f32(x, out, planes, params, to_nhwc)


def quantize_into(out: torch.Tensor, x: torch.Tensor, params: QuantizeParams, *, to_nhwc: bool) -> torch.Tensor:
    """``qparams.quantize`` of the dense float32 ``x`` into ``out`` (uint8, or int8), one read and one write per
    value (``quantize_f32``): in ``x``'s memory order, or with ``to_nhwc`` from a contiguous (N, C, ...) ``x`` into
    a channels-last ``out`` in the same pass."""
    assert loader.loops is not None and x.dtype == torch.float32 and out.numel() == x.numel()
    info = torch.iinfo(out.dtype)
    assert out.dtype in (torch.uint8, torch.int8) and info.min <= params.qmin <= params.qmax <= info.max
    quantize_call(x.shape, params, to_nhwc=to_nhwc)(x.data_ptr(), out.data_ptr())
    return out


def channel_means_call(shape: Sequence[int], strides: Triple, levels: ByteLevels) -> Callable[[int, int], None]:
    """``mean_u8`` for a uint8 tensor of ``shape`` (N, C, ...) and ``strides`` (see :func:`channel_means_into`), as
    ``run(a address, out address)``."""
    planes = Planes(shape[0], shape[1], math.prod(shape[2:]))
    mean_u8 = extension.mean_u8
    return lambda a, out: mean_u8(a, out, planes, strides, levels)


def channel_means_into(out: torch.Tensor, a: torch.Tensor, strides: Triple, levels: ByteLevels) -> torch.Tensor:
    """The global average pool of uint8 ``a`` (N, C, ...) into the dense uint8 ``out`` (N, C, 1, ...): per channel,
    the mean of the centered integers rounded half to even, exactly (``mean_u8``). ``strides``: (sample, channel,
    position) element strides of ``a`` seen as (N, C, positions); at most ``2**32 // 255`` positions."""
    assert loader.loops is not None and a.dtype == torch.uint8 and out.dtype == torch.uint8 and out.is_contiguous()
    assert a.dim() >= 3 and out.numel() == a.shape[0] * a.shape[1]
    channel_means_call(a.shape, strides, levels)(a.data_ptr(), out.data_ptr())
    return out


def max_pool_call(shape: PoolShape, window: PoolWindow) -> Callable[[int, int], None]:
    """``max_pool_u8`` on a dense channels-last uint8 input of ``shape``, as ``run(x address, out address)``."""
    max_pool_u8 = extension.max_pool_u8
    return lambda x, out: max_pool_u8(x, out, shape, window)


def mul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layout: MulLayout,
             requant: MulRequant) -> torch.Tensor:
    """The product of the uint8 activations ``a`` and ``b`` (of ``a``'s shape, or broadcast: an SE gate) into
    ``out``, each value rounded once as ``requant`` says, in the float type the torch path computes in, so the
    same bits (``mul_u8``)."""
    assert loader.loops is not None and a.dtype == b.dtype == out.dtype == torch.uint8
    extension.mul_u8(layout.shape, Bytes3(a.data_ptr(), layout.a), Bytes3(b.data_ptr(), layout.b),
                     Bytes3(out.data_ptr(), layout.out), requant)
    return out


def lookup_into(out: torch.Tensor, a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``out[i] = table[a[i]]`` over the raw bytes of ``a`` and ``out`` (same shape and dense format; uint8, int8 or
    quint8 storage), by the C loop (``lookup_u8``); the caller checks that the loops are there."""
    assert loader.loops is not None and out.shape == a.shape and table.numel() == 256 and table.dtype == torch.uint8
    extension.lookup_u8(a.data_ptr(), out.data_ptr(), a.numel(), table.data_ptr())
    return out


def concat(values: Sequence[torch.Tensor], dim: int,
           empty: Callable[[list[int]], torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(values, dim)`` of one-byte activations by row copies (``copy_rows``), or None (nothing done) where
    the loops are missing, a trace records the torch op, or the layouts are not row-major or channels-last with
    ``dim`` the channels. ``empty(shape)``: a contiguous output of the inputs' kind (quantized dtypes carry their
    scale). torch's cat interleaves channels-last inputs one element at a time; a row copy per input moves whole
    runs of channels."""
    first = values[0] if values else None
    if not loader.available() or first is None or torch.jit.is_tracing() or first.element_size() != 1:
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
        extension.copy_rows(ByteRows(v.data_ptr(), width), ByteRows(out.data_ptr() + offset, out_width), rows, width)
        offset += width
    return out.movedim(-1, 1) if channels_last else out

"""Element-wise int8 ops on plain ``torch.uint8`` activations, shared by the reference and oneDNN backends.

Both backends represent an activation as a plain integer tensor plus fxquant's :class:`QParams`, so quantize,
dequantize, add, relu, the average pools and the weight checks are the same code; only linear/conv differ.
``requantize`` is the one place where an accumulator is scaled, rounded (half to even, like ``torch.round`` and the
kernels' ``nearbyint``), shifted by the output zero point and clamped; a fused ReLU is a clamp at the zero point.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from fxquant import native
from fxquant.errors import ConfigError
from fxquant.kernels import recording
from fxquant.kernels.base import Backend
from fxquant.native.scratch import scratch_like
from fxquant.qparams import QParams, dequantize, quantize

_ADAPTIVE_POOLS = {3: F.adaptive_avg_pool1d, 4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}
_AVG_POOLS = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_QUANTIZE_CHUNK = 1 << 18  # float32 elements per quantize step: a 1 MiB buffer that stays in L2
_SMALL = 1 << 15  # up to this many elements quantize runs the formula as is: chunking costs more than it saves
_MEAN_POSITIONS = (2**32 - 1) // 255  # the C mean's 32-bit sums hold this many uint8 values per channel


def requantize(acc: torch.Tensor, multiplier: torch.Tensor | float, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    """``clamp(round(acc * multiplier) + zero_point, qmin, qmax)`` as ``out_qp``'s integer dtype.

    ``acc`` is in units of ``1 / multiplier`` output steps (an int32 accumulator, or a float sum); the arithmetic
    runs in ``acc``'s float dtype (float64 for integer accumulators) so that only the final rounding is inexact.
    """
    scale_dtype = acc.dtype if acc.is_floating_point() else torch.float64
    return stored(acc.to(scale_dtype) * multiplier, out_qp, relu=relu).to(out_qp.dtype)


def stored(values: torch.Tensor, qp: QParams, *, relu: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``clamp(round(values) + zero_point, qmin, qmax)`` as int16 (in ``out`` if given); rounds and clamps
    ``values`` in place. A ReLU is a clamp at the zero point.

    int16, because torch converts float to int16 and int16 to uint8 with vector code but float to uint8 one value
    at a time (docs/backends.md, "Plain int8 ops"); clamping to ``[qmin - zero_point, qmax - zero_point]`` before
    adding the zero point keeps the result exact.
    """
    zero_point = int(qp.zero_point)
    low = max(qp.qmin, zero_point) if relu else qp.qmin
    values.round_().clamp_(low - zero_point, qp.qmax - zero_point)
    ints = values.to(torch.int16) if out is None else out.copy_(values)
    return ints.add_(zero_point)


def weight_scale(w_qp: QParams, weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight scales (0-d, or one per output channel), once the weights are checked to be what int8
    kernels take: plain int8, symmetric (zero point 0), per-tensor or per-channel along axis 0."""
    problem = ""
    if weight.dtype != torch.int8:
        problem = f"weights must be torch.int8, got {weight.dtype}"
    elif w_qp.axis not in (None, 0) or (w_qp.axis == 0 and w_qp.scale.numel() != weight.shape[0]):
        problem = f"per-channel weight qparams must have one scale per output channel (axis 0), got axis={w_qp.axis}"
    elif bool((w_qp.zero_point != 0).any()):
        problem = "int8 kernels need symmetric weights (zero point 0)"
    if problem:
        raise ConfigError(f"{problem}; use a symmetric weight observer (per-tensor or per-channel on axis 0)")
    return w_qp.scale.detach().to(torch.float32)


def centered(a: torch.Tensor, qp: QParams, dtype: torch.dtype) -> torch.Tensor:
    """``a - zero_point`` in float ``dtype``: exact, since 9-bit integers fit any float mantissa."""
    return a.to(dtype, copy=True).sub_(int(qp.zero_point))


def _per_dim(value: Any, dim: int) -> tuple[int, ...]:
    return (value,) * dim if isinstance(value, int) else tuple(value)


def window_max(a: torch.Tensor, dim: int, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.max_poolNd`` over non-overlapping windows (stride == kernel <= 4, no padding or dilation, floor mode) as
    element-wise maxima of strided views, in ``a``'s layout; None for other pools.

    torch's integer max-pools are scalar loops on contiguous input, so a channels-last tensor is copied first; the
    strided maxima need neither (bit-identical; docs/backends.md, "Plain int8 ops").
    """
    kernel = _per_dim(kwargs["kernel_size"], dim)
    plain = (_per_dim(kwargs.get("stride") or kernel, dim) == kernel and max(kernel) <= 4
             and not any(_per_dim(kwargs.get("padding") or 0, dim)) and set(_per_dim(kwargs.get("dilation") or 1, dim))
             == {1} and not kwargs.get("ceil_mode") and not kwargs.get("return_indices"))
    if not plain or any(size < k for size, k in zip(a.shape[-dim:], kernel, strict=True)):
        return None
    out = a
    for axis, k in zip(range(a.dim() - dim, a.dim()), kernel, strict=True):
        if k > 1:
            count = out.shape[axis] // k
            windows = out.narrow(axis, 0, count * k).unflatten(axis, (count, k))
            out = windows.select(axis + 1, 0)
            for j in range(1, k):
                out = torch.maximum(out, windows.select(axis + 1, j))
    return out if out is not a else a.clone()


def _native_quantize(x: torch.Tensor, qp: QParams, channels_last: bool) -> torch.Tensor | None:
    """``qparams.quantize`` by the C loop (one read, one write per value; ``fxquant/native/csrc/elementwise.c``), or
    None where it does not apply: no C loop, not float32 on the CPU, per-channel, or memory that is neither contiguous
    nor (4-d) channels-last. A contiguous NCHW input becomes channels-last in the same pass, which saves the torch
    path's separate NCHW -> NHWC copy (docs/backends.md, "Plain int8 ops")."""
    if (not native.available() or x.dtype != torch.float32 or x.device.type != "cpu" or qp.per_channel
            or qp.dtype not in (torch.uint8, torch.int8) or x.numel() == 0):
        return None
    scale, zero_point = qp.scalar()
    to_nhwc = channels_last and x.is_contiguous() and x.shape[1] > 1 and x[0, 0].numel() > 1
    if channels_last and not (to_nhwc or x.is_contiguous(memory_format=torch.channels_last)):
        return None
    if not (channels_last or x.is_contiguous()):
        return None
    layout = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty_like(x, dtype=qp.dtype, memory_format=layout)
    params = native.QuantizeParams(scale, zero_point, qp.qmin, qp.qmax)
    native.quantize_into(out, x, params, to_nhwc=to_nhwc)
    if recording.active():  # a replay repeats the call (fxquant.runtime.replay)
        recording.record(native.quantize_call(x.shape, params, to_nhwc=to_nhwc), x.data_ptr(), out)
    return out


def _flat_stride(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The one stride that walks all of ``sizes`` in order, or None if their memory is not evenly spaced."""
    dims = [(size, stride) for size, stride in zip(sizes, strides, strict=True) if size != 1]
    if not dims:
        return 1
    for (_, outer), (size, inner) in itertools.pairwise(dims):
        if outer != inner * size:
            return None
    return dims[-1][1]


def _three_strides(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(sample, channel, position) strides of ``t`` viewed as (N, C, positions); None if its positions are not
    evenly spaced in memory."""
    inner = _flat_stride(tuple(t.shape[2:]), t.stride()[2:])
    return None if inner is None else (t.stride(0), t.stride(1), inner)


def _native_global_mean(a: torch.Tensor, qp: QParams, output_size: Any) -> torch.Tensor | None:
    """A global average pool (every output size 1) of uint8 activations by the C loop: one read of ``a``, exact
    integer rounding (the float64 path's result; float32 agrees but at a rounding tie a few ulps away). None where
    it does not apply: no C loop, another output size or dtype, per-channel qparams, spatial memory that is not
    evenly spaced, more positions per channel than a 32-bit sum holds. One pass instead of the torch path's several
    (docs/backends.md, "Plain int8 ops")."""
    ones = (1,) * (a.dim() - 2)
    pools_to_one = output_size == 1 if isinstance(output_size, int) else tuple(output_size) == ones
    if (not native.available() or not pools_to_one or a.dtype != torch.uint8
            or a.device.type != "cpu" or qp.per_channel or a.dim() < 3 or a.numel() == 0):
        return None
    strides, positions = _three_strides(a), math.prod(a.shape[2:])
    if strides is None or positions > _MEAN_POSITIONS:
        return None
    out = torch.empty((a.shape[0], a.shape[1], *ones), dtype=torch.uint8)
    levels = native.ByteLevels(qp.scalar()[1], qp.qmin, qp.qmax)
    native.channel_means_into(out, a, strides, levels)
    if recording.active():
        recording.record(native.channel_means_call(a.shape, strides, levels), a.data_ptr(), out)
    return out


def _native_mul(a: torch.Tensor, b: torch.Tensor, qps: tuple[QParams, QParams, QParams],
                dtype: torch.dtype) -> torch.Tensor | None:
    """``PlainInt8Backend.mul`` by the C loop, the same operations in ``dtype`` (so the same bits) in one pass:
    ``a`` full size, ``b`` of ``a``'s shape or broadcast over its positions (an SE gate, (N, C, 1, 1)). None where it
    does not apply: no C loop, other dtypes or shapes, per-channel qparams, positions not evenly spaced. One pass
    instead of the torch path's seven (docs/backends.md, "Plain int8 ops")."""
    qa, qb, qout = qps
    if (not native.available() or a.dtype != torch.uint8 or b.dtype != torch.uint8 or qout.dtype != torch.uint8
            or dtype not in (torch.float32, torch.float64) or a.dim() < 3 or b.dim() != a.dim()
            or any(qp.per_channel for qp in qps) or a.device.type != "cpu" or b.device.type != "cpu"
            or torch.broadcast_shapes(a.shape, b.shape) != a.shape or b.shape[:2] != a.shape[:2]):
        return None
    gate = b.numel() == a.shape[0] * a.shape[1]
    if not gate and b.shape != a.shape:
        return None
    out = torch.empty_like(a)
    strides = [_three_strides(a), (b.stride(0), b.stride(1), 0) if gate else _three_strides(b), _three_strides(out)]
    if any(s is None for s in strides):
        return None
    rows = [s for s in strides if s is not None]
    dims = (a.shape[0], a.shape[1], math.prod(a.shape[2:]))
    if rows[0][1] < rows[0][2]:  # channels-last: rows of channels, one per position
        dims, rows = (dims[0], dims[2], dims[1]), [(s[0], s[2], s[1]) for s in rows]
    (sa, za), (sb, zb), (so, zo) = qa.scalar(), qb.scalar(), qout.scalar()
    requant = native.MulRequant(za, zb, zo, qout.qmin, qout.qmax, sa * sb / so, dtype == torch.float64)
    return native.mul_into(out, a, b, native.MulLayout(dims, rows[0], rows[1], rows[2]), requant)


class PlainInt8Backend(Backend):
    """Quantize/dequantize/add/relu/pools for backends whose activations are plain uint8 tensors.

    ``elementwise_dtype`` is the float type add and the pools compute in: float64 for the reference backend, where
    every intermediate value except the final division is exact, float32 where speed matters more than a rare
    one-step difference at a rounding tie.
    """

    elementwise_dtype: ClassVar[torch.dtype] = torch.float64
    # Whether 4-d activations are made channels-last where they enter int8 (the layout oneDNN convs compute in).
    channels_last: ClassVar[bool] = False

    def quantize(self, x: torch.Tensor, qp: QParams) -> torch.Tensor:
        fast = _native_quantize(x.detach(), qp, self.channels_last and x.dim() == 4)
        if fast is not None:
            return fast
        # Without the C loop (or for float16/float64, per-channel, odd strides): ``qparams.quantize`` step by step,
        # in place on buffers of a few samples that stay in cache: a model's input is its largest activation, and a
        # fresh float copy of all of it costs page faults and memory traffic (docs/backends.md, "Plain int8 ops").
        # The division reads ``x`` straight into the float buffer.
        if torch.compiler.is_exporting() or qp.per_channel or x.dim() < 2 or x.numel() <= _SMALL:
            # the plain formula: fewer ops, so faster below a few cache lines' worth; and what torch.export records
            # (the chunks below would fix the batch size)
            q = quantize(x.detach(), qp)
            return q.contiguous(memory_format=torch.channels_last) if self.channels_last and q.dim() == 4 else q
        x = x.detach()  # rounding has no gradient; ``out=`` ops refuse inputs that require one
        scale = qp.scalar()[0]
        channels_last = self.channels_last and x.dim() == 4
        out = torch.empty_like(x, dtype=qp.dtype,
                               memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        rows = min(x.shape[0], max(1, _QUANTIZE_CHUNK // (x.numel() // x.shape[0])))
        buffer = scratch_like("quantize float", (rows, *x.shape[1:]), torch.float32, channels_last=channels_last)
        narrow = scratch_like("quantize int16", (rows, *x.shape[1:]), torch.int16, channels_last=channels_last)
        for start in range(0, x.shape[0], rows):
            count = min(rows, x.shape[0] - start)
            chunk, ints = buffer[:count], narrow[:count]
            if x.dtype == torch.float32:
                torch.div(x[start:start + count], scale, out=chunk)
            else:  # a division in float16 would round before the widening copy
                chunk.copy_(x[start:start + count]).div_(scale)
            out[start:start + count].copy_(stored(chunk, qp, out=ints))
        return out

    def dequantize(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        if a.is_floating_point():  # a Linear with a float output (``linear_to_float``) is already there
            return a
        if qp.per_channel:
            return dequantize(a, qp)
        scale, zero_point = qp.scalar()
        return a.to(torch.float32).sub_(zero_point).mul_(scale)  # qparams.dequantize in place: one buffer

    def from_bytes(self, stored: torch.Tensor, qp: QParams) -> torch.Tensor:
        return stored.view(qp.dtype)

    def to_bytes(self, a: torch.Tensor) -> torch.Tensor:
        return a.view(torch.uint8)

    def lookup(self, a: torch.Tensor, table: torch.Tensor, qout: QParams) -> torch.Tensor:
        if a.dtype not in (torch.uint8, torch.int8):  # the table reads raw bytes: another dtype would be misread
            raise TypeError(f"an int8 lookup takes uint8/int8 activations, got {a.dtype}")
        if native.available() and not torch.jit.is_tracing() and native.dense_format(a) is not None:
            out = native.lookup_into(torch.empty_like(a, dtype=torch.uint8), a, table)
        else:  # a traced model records torch ops; the table is the same
            out = table[a.view(torch.uint8).long()]
        return out.view(qout.dtype)

    def add(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams, *,
            relu: bool) -> torch.Tensor:
        # (qa - za) * sa is a 9-bit integer times a float32 scale: exact in float64, and so is the sum of two of
        # them unless the scales differ by ~2^20. The division by the output scale is the one rounding step.
        # In place on two buffers: the same operations as ``requantize`` (element-wise ops are memory-bound).
        dtype = self.elementwise_dtype
        (sa, za), (sb, zb), scale = qa.scalar(), qb.scalar(), float(qout.scale)
        total = a.to(dtype).sub_(za).mul_(sa).add_(b.to(dtype).sub_(zb).mul_(sb))
        return stored(total.mul_(1.0 / scale), qout, relu=relu).to(qout.dtype)

    def mul(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams) -> torch.Tensor:
        # ``(qa - za) * (qb - zb) * (sa * sb / so)``, rounded once: the centered integers are exact in any float
        # type, and so is their product in float64 (|product| < 2^17). The smaller operand (an SE gate of shape
        # (N, C, 1, 1)) takes the scale factor, so the large one is read once into the product's buffer.
        if a.numel() < b.numel():
            a, b, qa, qb = b, a, qb, qa
        dtype = self.elementwise_dtype
        fast = _native_mul(a, b, (qa, qb, qout), dtype)
        if fast is not None:
            return fast
        factor = centered(b, qb, dtype).mul_(float(qa.scale) * float(qb.scale) / float(qout.scale))
        product = centered(a, qa, dtype)
        product = product.mul_(factor) if product.shape == torch.broadcast_shapes(a.shape, b.shape) else \
            product * factor
        return stored(product, qout).to(qout.dtype)

    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        # Real zero is the zero point, so ReLU never needs the scale. clamp reads strides, so a channels-last
        # input (oneDNN conv output) is handled as it is.
        return torch.clamp(a, min=int(qp.zero_point))

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        # torch 2.13's channels-last max-pool kernel rejects int8/uint8 inputs with more than 127 positions per
        # channel ("Expected input_depth * input_height * input_width <= ..."); oneDNN convs return channels-last.
        windows = window_max(a, dim, kwargs)
        return windows if windows is not None else super().max_pool(a.contiguous(), qp, dim, kwargs)

    def adaptive_avg_pool(self, a: torch.Tensor, qp: QParams, output_size: Any) -> torch.Tensor:
        fast = _native_global_mean(a, qp, output_size)
        if fast is not None:
            return fast
        # Every output is a mean, so the zero point comes off the (small) pooled result: one full-size pass fewer
        # than pooling ``a - zero_point`` (SE blocks, classifier heads; docs/backends.md, "Plain int8 ops").
        pooled = _ADAPTIVE_POOLS[a.dim()](a.to(self.elementwise_dtype), output_size).sub_(int(qp.zero_point))
        return requantize(pooled, 1.0, qp, relu=False)

    def avg_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        # Pooling ``a - zero_point`` (not ``a``) makes zero padding mean real zero, as count_include_pad expects;
        # with the same qparams in and out, the result is the rounded mean of the integers.
        pooled = _AVG_POOLS[dim](centered(a, qp, self.elementwise_dtype), **kwargs)
        return requantize(pooled, 1.0, qp, relu=False)

"""Max-pooling plain uint8 channels-last: fxquant's C loop, else ``quantized::max_pool2d`` (the op Inductor's PT2E
lowering calls).

Both run channels-last, where aten's uint8 max-pool runs contiguous only and is far slower (docs/backends.md, "What
else the backend does"); the C loop is one vector max per tap and 64 channels, records its call for a replayed run
(:mod:`fxquant.runtime.replay`), and gives the same bytes (a max is exact). 1-d pools run over a height of one; 3-d
pools, other dtypes and torch builds without the op (and the C loop) take the base backend's pool.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fxquant import native
from fxquant.kernels import recording

_LOOP_ROWS = 64  # FXQ_POOL_MAX_KERNEL (fxquant/native/csrc/native.h): window rows the C loop holds
Arguments = tuple[list[int], list[int], list[int], list[int], bool]  # kernel, stride, padding, dilation, ceil_mode


def channels_last_max_pool(a: torch.Tensor, dim: int, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.max_poolNd(a, **kwargs)`` on channels-last uint8 by the C loop or else ``quantized::max_pool2d``, or None
    where neither applies (``dim`` 3, ``a`` not uint8, no loop and no such op)."""
    if dim == 3 or a.dtype != torch.uint8:
        return None
    x = a.unsqueeze(-2) if dim == 1 else a
    batched = x.dim() == 4
    x = (x if batched else x.unsqueeze(0)).contiguous(memory_format=torch.channels_last)
    arguments = _pool2d_arguments(dim, kwargs)
    out = _native_max_pool(x, arguments)
    if out is None:
        if not _has_uint8_max_pool():
            return None
        out = torch.ops.quantized.max_pool2d(x, *arguments)
    out = out if batched else out.squeeze(0)
    return out.squeeze(-2) if dim == 1 else out


def _pooled_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """torch's pooled size: with ``ceil_mode`` a last window must still start inside the input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    return out - 1 if ceil_mode and (out - 1) * stride >= size + padding else out


def _native_max_pool(x: torch.Tensor, arguments: Arguments) -> torch.Tensor | None:
    """The pool of the channels-last uint8 ``x`` (N, C, H, W) by the C loop, or None where it does not apply: no C
    loop, a trace or compile (they record torch ops), padding over half the window (torch's error), a window of
    more than ``_LOOP_ROWS`` rows, an empty input or output."""
    kernel, stride, padding, dilation, ceil_mode = arguments
    if (not native.available() or torch.jit.is_tracing() or torch.compiler.is_compiling() or x.device.type != "cpu"
            or x.numel() == 0 or kernel[0] > _LOOP_ROWS
            or any(2 * p > k for p, k in zip(padding, kernel, strict=True))):
        return None
    sizes = [_pooled_size(x.shape[2 + i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode) for i in (0, 1)]
    if min(sizes) < 1:
        return None
    out = torch.empty((x.shape[0], x.shape[1], *sizes), dtype=torch.uint8, memory_format=torch.channels_last)
    shape = native.PoolShape(x.shape[0], x.shape[2], x.shape[3], x.shape[1], *sizes)
    call = native.max_pool_call(shape, native.PoolWindow(*kernel, *stride, *padding, *dilation))
    call(x.data_ptr(), out.data_ptr())
    recording.record(call, x.data_ptr(), out)
    return out


@functools.cache
def _has_uint8_max_pool() -> bool:
    """Whether this torch has ``quantized::max_pool2d`` (it may leave with the quantized dtypes one day)."""
    try:
        torch.ops.quantized.max_pool2d  # noqa: B018  (resolving the op is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


def _pool2d_arguments(dim: int, kwargs: dict[str, Any]) -> Arguments:
    """``F.max_poolNd`` keyword arguments (dim 1 or 2) as ``quantized::max_pool2d``'s positional ones; 1-d pools
    run over a height of one. Worked out once per pool (``_cached_pool2d_arguments``): a pool runs on every call."""
    try:
        return _cached_pool2d_arguments(dim, tuple(kwargs.items()))
    except TypeError:  # an unhashable value (a list): work it out each time
        return _cached_pool2d_arguments.__wrapped__(dim, tuple(kwargs.items()))


@functools.lru_cache(maxsize=1024)
def _cached_pool2d_arguments(dim: int, items: tuple[tuple[str, Any], ...]) -> Arguments:
    kwargs = dict(items)

    def pair(value: Any, default: int) -> list[int]:
        value = default if value is None else value
        values = [value] * dim if isinstance(value, int) else list(value)
        return [default] * (2 - dim) + values if dim == 1 else values

    kernel = pair(kwargs["kernel_size"], 1)
    stride = pair(kwargs.get("stride") or kwargs["kernel_size"], 1)
    return (kernel, stride, pair(kwargs.get("padding"), 0), pair(kwargs.get("dilation"), 1),
            bool(kwargs.get("ceil_mode", False)))

"""Max-pooling plain uint8 with ``quantized::max_pool2d``, the op Inductor's PT2E lowering calls.

The op takes plain uint8 (no quantized dtype) and runs channels-last, where aten's uint8 max-pool runs contiguous
only and is far slower (docs/backends.md, "What else the backend does"). 1-d pools run over a height of one; 3-d
pools, other dtypes and torch builds without the op take the base backend's pool.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def channels_last_max_pool(a: torch.Tensor, dim: int, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``F.max_poolNd(a, **kwargs)`` by ``quantized::max_pool2d`` on channels-last uint8, or None where it does not
    apply (``dim`` 3, ``a`` not uint8, no such op)."""
    if dim == 3 or a.dtype != torch.uint8 or not _has_uint8_max_pool():
        return None
    x = a.unsqueeze(-2) if dim == 1 else a
    batched = x.dim() == 4
    x = (x if batched else x.unsqueeze(0)).contiguous(memory_format=torch.channels_last)
    out = torch.ops.quantized.max_pool2d(x, *_pool2d_arguments(dim, kwargs))
    out = out if batched else out.squeeze(0)
    return out.squeeze(-2) if dim == 1 else out


@functools.cache
def _has_uint8_max_pool() -> bool:
    """Whether this torch has ``quantized::max_pool2d`` (it may leave with the quantized dtypes one day)."""
    try:
        torch.ops.quantized.max_pool2d  # noqa: B018  (resolving the op is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


def _pool2d_arguments(dim: int, kwargs: dict[str, Any]) -> tuple[list[int], list[int], list[int], list[int], bool]:
    """``F.max_poolNd`` keyword arguments (dim 1 or 2) as ``quantized::max_pool2d``'s positional ones; 1-d pools
    run over a height of one. Worked out once per pool (``_cached_pool2d_arguments``): a pool runs on every call."""
    try:
        return _cached_pool2d_arguments(dim, tuple(kwargs.items()))
    except TypeError:  # an unhashable value (a list): work it out each time
        return _cached_pool2d_arguments.__wrapped__(dim, tuple(kwargs.items()))


@functools.lru_cache(maxsize=1024)
def _cached_pool2d_arguments(dim: int, items: tuple[tuple[str, Any], ...]) -> tuple[list[int], list[int], list[int],
                                                                                    list[int], bool]:
    kwargs = dict(items)

    def pair(value: Any, default: int) -> list[int]:
        value = default if value is None else value
        values = [value] * dim if isinstance(value, int) else list(value)
        return [default] * (2 - dim) + values if dim == 1 else values

    kernel = pair(kwargs["kernel_size"], 1)
    stride = pair(kwargs.get("stride") or kwargs["kernel_size"], 1)
    return (kernel, stride, pair(kwargs.get("padding"), 0), pair(kwargs.get("dilation"), 1),
            bool(kwargs.get("ceil_mode", False)))

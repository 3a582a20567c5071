"""Per-thread scratch buffers for hot element-wise loops (histogram counting, plain-int8 quantize).

A fresh batch-sized temporary costs more in page faults than the arithmetic done in it (large allocations come
straight from the kernel, zero-filled on first touch), so loops that need one per call reuse a buffer kept per
thread and per (name, dtype). Buffers grow to the largest size asked for and never shrink: the callers bound that
size (a chunk of values, or a few samples).
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def scratch(name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused 1-D buffer of exactly ``size`` elements for this thread (a view of one that may be larger).

    Its contents are whatever the last user left: write before reading. Two live uses need two names.
    """
    key = (name, dtype)
    buffers: dict[tuple[str, torch.dtype], torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < size:
        with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode
            buffer = buffers[key] = torch.empty(size, dtype=dtype)
    return buffer[:size]


def scratch_like(name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *,
                 channels_last: bool = False) -> torch.Tensor:
    """A scratch tensor of ``shape``, contiguous or (4-d only) channels-last, backed by :func:`scratch`."""
    flat = scratch(name, int(torch.Size(shape).numel()), dtype)
    if channels_last and len(shape) == 4:
        n, c, h, w = shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(shape)

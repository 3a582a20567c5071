"""The optional C loops (``fxquant/_native.c``), or None when fxquant was installed without a C compiler.

Every caller keeps a torch path with the same results: the loops are speed, never semantics.
"""

from __future__ import annotations

from types import ModuleType

import torch

loops: ModuleType | None
try:
    from fxquant import _native as loops
except ImportError:  # no compiler at install time: the torch paths
    loops = None


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def dense_format(a: torch.Tensor) -> torch.memory_format | None:
    """The memory format in which ``a``'s elements fill its memory in order (a byte loop can then read it flat), or
    None for other strides (slices, transposes)."""
    if a.is_contiguous():
        return torch.contiguous_format
    channels_last = _CHANNELS_LAST.get(a.dim())
    return channels_last if channels_last is not None and a.is_contiguous(memory_format=channels_last) else None


def lookup_into(out: torch.Tensor, a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``out[i] = table[a[i]]`` over the raw bytes of ``a`` and ``out`` (same shape and dense format; uint8, int8 or
    quint8 storage), by the C loop; the caller checks that ``loops`` is there."""
    assert loops is not None and out.shape == a.shape and table.numel() == 256 and table.dtype == torch.uint8
    loops.lookup_u8(a.data_ptr(), out.data_ptr(), a.numel(), table.data_ptr())
    return out

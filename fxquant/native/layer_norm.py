"""Typed wrapper of the residual add and LayerNorm loop (``fxquant/native/csrc/layer_norm.c``): ``LayerNorm(a + b)``
over the last dim of float32 rows in one pass per row. Who calls it, and why: :mod:`fxquant.runtime.add_norm`."""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.loader import extension


def add_layer_norm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, eps: float) -> bool:
    """``out = F.layer_norm(a + b, (width,), weight, bias, eps)`` up to float32 rounding, from contiguous float32 CPU
    ``a`` and ``b`` whose last dim is ``width``: ``b`` of ``a``'s shape, or of its trailing dims (with leading ones:
    a broadcast add, ``b``'s rows repeating over ``a``'s); ``weight`` and ``bias``: None or contiguous float32 of
    ``width`` values (``bias`` only with ``weight``); ``out`` contiguous, of ``a``'s shape, overlapping neither.
    False (nothing written) where the loop cannot run: no C extension, or ``FXQUANT_NATIVE=0``."""
    if loader.loops_for("layer_norm") is None:
        return False
    width = a.shape[-1]
    extension.add_layer_norm_f32((a.data_ptr(), b.data_ptr(), out.data_ptr()),
                                 (a.numel() // width, b.numel() // width, width),
                                 (0 if weight is None else weight.data_ptr(), 0 if bias is None else bias.data_ptr()),
                                 eps)
    return True

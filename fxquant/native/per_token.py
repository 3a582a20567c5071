"""Typed wrappers of the dynamic per-token INT8 loops: a row's quantize and the int32-to-float rescale around
``torch._int_mm`` (``fxquant/native/csrc/elementwise.c``, one pass each where torch takes one per step), and the
few-row VNNI GEMM that replaces both ``torch._int_mm`` and the rescale on a decode step (``int8_rows.c``). Each
gives the bytes of the torch path it replaces (:mod:`fxquant.kernels.per_token`)."""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.loader import extension


def quantize_rows_into(q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> bool:
    """``q`` (dense int8, rows' shape) and ``scale`` (dense float32, one per row) from 2-d float32 ``rows`` with unit
    column stride; False (nothing written) where the loops are off or the thread rule yields."""
    if loader.loops_for("elementwise") is None:
        return False
    extension.quantize_rows_s8((rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0)), q.data_ptr(),
                               scale.data_ptr())
    return True


def rescale_rows_into(out: torch.Tensor, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> bool:
    """Dense float32 ``out = acc * row_scale[:, None] * col_scale + bias`` from dense int32 ``acc``; False (nothing
    written) where the loops are off or the thread rule yields."""
    if loader.loops_for("elementwise") is None:
        return False
    extension.rescale_rows((acc.data_ptr(), acc.shape[0], acc.shape[1]),
                           (row_scale.data_ptr(), col_scale.data_ptr(), 0 if bias is None else bias.data_ptr()),
                           out.data_ptr())
    return True


def int8_rows_into(out: torch.Tensor, q: torch.Tensor, row_scale: torch.Tensor, weight: torch.Tensor,
                   weight_sums: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Dense float32 ``out = (q @ weight.T) * row_scale[:, None] * col_scale + bias`` from dense int8 ``q`` and
    ``weight`` (``weight_sums``: its int32 row sums); False (nothing written) without AVX512-VNNI, where the loops are
    off or the thread rule yields (``loops_for("int8_rows")``)."""
    if loader.loops_for("int8_rows") is None:
        return False
    return extension.int8_rows_f32((q.data_ptr(), row_scale.data_ptr(), q.shape[0]),
                                   (weight.data_ptr(), weight_sums.data_ptr(), col_scale.data_ptr(),
                                    0 if bias is None else bias.data_ptr(), weight.shape[1], weight.shape[0]),
                                   out.data_ptr())

"""Typed wrappers of the dynamic per-token INT8 loops: a row's quantize and the int32-to-float rescale around
``torch._int_mm`` (``fxquant/native/csrc/elementwise.c``, one pass each where torch takes one per step), and the
few-row VNNI Linear that replaces the quantize, ``torch._int_mm`` and the rescale on a decode step in one call
(``int8_rows.c``). Each gives the bytes of the torch path it replaces (:mod:`fxquant.kernels.per_token`).

Every call takes SmoothQuant's ``input_scale`` (the factor per input channel the rows are multiplied by before they
are quantized) or None, so the multiply is not a separate torch op and pass.
"""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.loader import extension


def address(tensor: torch.Tensor | None) -> int:
    """The address of ``tensor``'s data for a C call; 0 (the C side's "none") for None."""
    return 0 if tensor is None else tensor.data_ptr()


def row_layout(t: torch.Tensor) -> tuple[int, int]:
    """The rows of ``t`` (along its last dimension) and their stride in elements, for ``t`` dense of any shape (its
    stride along a dimension of size one says nothing) or 2-d with unit column stride."""
    return t.numel() // t.shape[-1], t.shape[-1] if t.is_contiguous() else t.stride(0)


def quantize_rows_into(q: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                       input_scale: torch.Tensor | None = None) -> bool:
    """``q`` (dense int8, rows' shape) and ``scale`` (dense float32, one per row) from 2-d float32 ``rows`` with unit
    column stride, times dense float32 ``input_scale`` (one per column) where given; False (nothing written) where
    the loops are off or the thread rule yields."""
    if loader.loops_for("elementwise") is None:
        return False
    extension.quantize_rows_s8((rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), address(input_scale)),
                               q.data_ptr(), scale.data_ptr())
    return True


def rescale_rows_into(out: torch.Tensor, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> bool:
    """Dense float32 ``out = acc * row_scale[:, None] * col_scale + bias`` from dense int32 ``acc``; False (nothing
    written) where the loops are off or the thread rule yields."""
    if loader.loops_for("elementwise") is None:
        return False
    extension.rescale_rows((acc.data_ptr(), acc.shape[0], acc.shape[1]),
                           (row_scale.data_ptr(), col_scale.data_ptr(), address(bias)), out.data_ptr())
    return True


def int8_rows_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_sums: torch.Tensor,
                   col_scale: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | None) -> bool:
    """Dense float32 ``out = (q @ weight.T) * row_scale[:, None] * col_scale + bias``, where ``q, row_scale`` are
    :func:`~fxquant.kernels.per_token.quantize_rows` of ``x * input_scale`` (``x`` alone without one): ``x`` float32
    of any shape, dense (its rows: the last dimension), dense int8 ``weight`` (out_features, in_features) with its
    int32 row sums ``weight_sums``, everything else dense float32. False (nothing written) without AVX512-VNNI, where
    the loops are off or the thread rule yields (``loops_for("int8_rows")``)."""
    if loader.loops_for("int8_rows") is None:
        return False
    out_features, in_features = weight.shape
    return extension.int8_rows_f32(
        (x.data_ptr(), address(input_scale), x.numel() // in_features, in_features),
        (weight.data_ptr(), weight_sums.data_ptr(), col_scale.data_ptr(), address(bias), in_features, out_features),
        out.data_ptr())

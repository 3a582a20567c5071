"""Typed wrapper of the per-group dynamic INT8 Linear loop (``fxquant/native/csrc/int8_groups.c``): quantize each
group of inputs of every row, sum on AVX512-VNNI and rescale, in one call for any number of rows
(:mod:`fxquant.kernels.per_group`, whose torch path gives the same bytes)."""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.loader import extension
from fxquant.native.per_token import address, row_layout


def int8_groups_into(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, group_sums: torch.Tensor,
                     col_scale: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | None,
                     group: int) -> bool:
    """Dense float32 ``out`` (..., out_features) of the per-group dynamic INT8 Linear
    (:func:`fxquant.kernels.per_group.per_group_linear`) from float32 ``x`` (..., in_features) with the same rows
    (along the last dimension), dense or 2-d with unit column stride, the weights packed by
    :func:`~fxquant.kernels.per_group.pack_weights` with their ``group_sums``, everything else dense float32. False
    (nothing written) without AVX512-VNNI or where the loops are off."""
    if loader.loops_for("int8_groups") is None:
        return False
    in_features, out_features = x.shape[-1], out.shape[-1]
    return extension.int8_groups_f32(
        (x.data_ptr(), address(input_scale), *row_layout(x)),
        (packed.data_ptr(), group_sums.data_ptr(), col_scale.data_ptr(), address(bias), in_features, out_features,
         packed.shape[0] * packed.shape[2], group),
        out.data_ptr())

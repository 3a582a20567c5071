"""Typed wrapper of the weight-only Linear loop (``fxquant/native/csrc/weight_only.c``): float32 rows times int8
weights widened in registers, for the few rows of an LLM's decode step (:mod:`fxquant.kernels.weight_only`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxquant.native import loader
from fxquant.native.loader import extension
from fxquant.native.per_token import row_layout


class FloatRows(NamedTuple):
    """The float32 inputs: address, SmoothQuant's factor per input channel that multiplies them first (dense float32;
    address 0: none), rows and the row stride in floats."""

    data: int
    input_scale: int
    rows: int
    stride: int


class Int8Weights(NamedTuple):
    """Dense (out_features, in_features) int8 weights, their dense float32 scales (out_features, in_features /
    group), an optional bias (address 0) per output."""

    w: int
    scale: int
    bias: int
    in_features: int
    out_features: int
    group: int


class FloatOut(NamedTuple):
    """The float32 outputs: address and the row stride in floats."""

    data: int
    stride: int


def weight_only_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> bool:
    """``out = (x * input_scale) @ dequantized.T + bias`` (``x`` alone without ``input_scale``) for float32 ``x``
    and ``out``, each 2-d with unit column stride or dense of any shape (rows: the last dimension), dense int8
    ``weight`` (out_features, in_features) and dense float32 ``scale``: one per output (1-d) or per group of inputs of
    each output (out_features, groups; a group a multiple of 16 inputs), ``dequantized`` each weight times its
    scale; False (nothing written) where the loops are off or the thread rule yields
    (``loader.loops_for("weight_only")``)."""
    if loader.loops_for("weight_only") is None:
        return False
    out_features, in_features = weight.shape
    rows, x_stride = row_layout(x)
    group = in_features // (scale.shape[1] if scale.dim() == 2 else 1)
    extension.weight_only_f32(
        FloatRows(x.data_ptr(), 0 if input_scale is None else input_scale.data_ptr(), rows, x_stride),
        Int8Weights(weight.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(), in_features,
                    out_features, group),
        FloatOut(out.data_ptr(), row_layout(out)[1]))
    return True

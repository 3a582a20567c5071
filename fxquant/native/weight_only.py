"""Typed wrapper of the weight-only Linear loop (``fxquant/native/csrc/weight_only.c``): float32 rows times int8
weights widened in registers, for the few rows of an LLM's decode step (:mod:`fxquant.kernels.weight_only`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxquant.native import loader
from fxquant.native.loader import extension


class FloatRows(NamedTuple):
    """The float32 inputs: address, rows and the row stride in floats."""

    data: int
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
                     bias: torch.Tensor | None) -> bool:
    """``out = x @ dequantized.T + bias`` for 2-d float32 ``x`` and ``out`` with unit column stride, dense int8
    ``weight`` (out_features, in_features) and dense float32 ``scale``: one per output (1-d) or per group of inputs
    of each output (out_features, groups; a group a multiple of 16 inputs), ``dequantized`` each weight times its
    scale; False (nothing written) where the loops are off or the thread rule yields
    (``loader.loops_for("weight_only")``)."""
    if loader.loops_for("weight_only") is None:
        return False
    rows, in_features = x.shape
    group = in_features // (scale.shape[1] if scale.dim() == 2 else 1)
    extension.weight_only_f32(
        FloatRows(x.data_ptr(), rows, x.stride(0)),
        Int8Weights(weight.data_ptr(), scale.data_ptr(), 0 if bias is None else bias.data_ptr(), in_features,
                    weight.shape[0], group),
        FloatOut(out.data_ptr(), out.stride(0)))
    return True

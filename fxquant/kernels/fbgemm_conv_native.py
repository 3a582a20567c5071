"""fbgemm's convs on AMX tiles: the C loop ``conv_u8`` (``fxquant/_native.c``), bit-identical to fbgemm's conv.

fbgemm builds an im2col copy of the input on every call and runs convs with few channels slowly on this kind of CPU
(one thread, batch 8, 64x64: 3->16 3x3 in 1.7 ms, 8 GMAC/s; 32->16 in 2.2 ms; 64->64 on 56x56 at ~200 GMAC/s).
With AMX-INT8 the C loop sums the same u8*s8 products exactly in int32 tiles straight from a zero-point-padded copy
of the input, then requantizes as fbgemm does (per output channel: ``(float(acc - z_x * sum(w)) + bias / (s_x *
s_w)) * (s_x * s_w / s_out)``, rounded to nearest even). Because the bytes are fbgemm's, a traced TorchScript export
(which records fbgemm's conv: the loop is skipped while tracing) computes what the eager model computes.

Taken for 1-, 2- and 3-d convs with groups 1, dilation 1, per-channel weights with zero point 0 (fxquant's fbgemm
default) and channels-last inputs; everything else, and CPUs without AMX, keeps fbgemm's conv. This module lays out
weights and requantization constants; the quantized tensors themselves are made in
:mod:`fxquant.kernels.quantized_engine`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fxquant import native
from fxquant.cpu import has_amx_int8
from fxquant.kernels.base import ConvSpec
from fxquant.qparams import QParams


@dataclass(frozen=True)
class NativeConv:
    """A conv's weight for the C loop: ``weight`` (kd * kh * kw * c_pad / 4, n_pad, 4) int8 - four consecutive
    (kernel column, channel) inputs of one output channel together, zeros for padding channels and beyond C_out;
    per-output-channel weight sums (the input zero point's share), float bias and weight scales, zero-padded to
    ``n_pad`` (a multiple of 16)."""

    weight: torch.Tensor
    column_sums: torch.Tensor
    bias: torch.Tensor
    weight_scales: torch.Tensor
    c_pad: int
    out_channels: int
    spec: ConvSpec
    kernel: tuple[int, int, int]  # depth, height, width (1 for the dimensions a 1-d or 2-d conv lacks)
    _factors: dict[tuple[float, float], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def factors(self, in_scale: float, out_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """fbgemm's per-channel requantization constants in float32, as it rounds them: ``bias / (s_x * s_w)`` and
        ``(s_x * s_w) / s_out`` (cached per pair of scales: they are fixed once a model is converted)."""
        key = (in_scale, out_scale)
        if key not in self._factors:
            product = torch.tensor(in_scale, dtype=torch.float32) * self.weight_scales
            self._factors[key] = (self.bias / product, product / torch.tensor(out_scale, dtype=torch.float32))
        return self._factors[key]


def native_conv(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec) -> NativeConv | None:
    """Lay out an int8 conv ``weight`` (C_out, C_in, *kernel) for the C loop, or None where the loop does not take
    it (grouped, dilated or transposed, weights per tensor or with zero points, no AMX, no C extension)."""
    if (native.loops is None or not has_amx_int8() or spec.groups != 1 or spec.transposed
            or any(d != 1 for d in spec.dilation) or w_qp.axis != 0 or bool(w_qp.zero_point.ne(0).any())):
        return None
    out_channels, in_channels = weight.shape[:2]
    kernel = (1,) * (5 - weight.dim()) + tuple(weight.shape[2:])
    c_pad, n_pad = -(-in_channels // 4) * 4, -(-out_channels // 16) * 16
    padded = weight.new_zeros(n_pad, *kernel, c_pad)
    padded[:out_channels, ..., :in_channels] = weight.reshape(out_channels, in_channels, *kernel).permute(0, 2, 3, 4, 1)
    sums = torch.zeros(n_pad, dtype=torch.int32)
    sums[:out_channels] = weight.reshape(out_channels, -1).sum(1, dtype=torch.int32)
    floats = torch.zeros(2, n_pad)
    if bias is not None:
        floats[0, :out_channels] = bias.detach().float()
    floats[1, :out_channels] = w_qp.scale.float()
    floats[1, out_channels:] = 1.0  # padding channels: any finite scale
    packed = padded.reshape(n_pad, math.prod(kernel) * c_pad // 4, 4).transpose(0, 1).contiguous()
    return NativeConv(packed, sums, floats[0].clone(), floats[1].clone(), c_pad, out_channels, spec,
                      (kernel[0], kernel[1], kernel[2]))

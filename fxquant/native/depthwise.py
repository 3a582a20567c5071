"""Typed wrapper of the depthwise 3x3 conv (``fxquant/native/csrc/depthwise_avx2.c``): one input channel per output
channel, stride 1 or 2, on AVX2 in exact integers with oneDNN's requantization. Which layers take it, and why:
:mod:`fxquant.kernels.onednn.depthwise` and docs/backends.md.
"""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.amx_gemm import OnednnRequant
from fxquant.native.loader import extension


def depthwise_weight(weight: torch.Tensor) -> torch.Tensor:
    """The conv's int8 (C, 1, 3, 3) ``weight`` as the kernel reads it: int16, laid out (C / 8, 5, 8, 2), per block of
    eight channels five pairs of taps (tap 3 kh + kw; the tenth tap 0) interleaved channel by channel. C must be a
    multiple of 8."""
    channels = weight.shape[0]
    taps = torch.zeros(channels, 10, dtype=torch.int16)
    taps[:, :9] = weight.reshape(channels, 9)
    return taps.reshape(channels // 8, 8, 5, 2).permute(0, 2, 1, 3).contiguous()


class OnednnDepthwise:
    """``dwconv3x3_onednn`` for one input shape as ``run(x address, out address)``; RuntimeError (nothing written)
    without AVX2. It holds the tensors whose addresses it passes, so a replay that keeps only ``run`` keeps them.

    ``shape``: the channels-last uint8 input's (N, C, H, W); ``padding``: (top/bottom, left/right), 0 or 1;
    ``stride``: 1 or 2 (both dims); ``zx``: the input zero point (what the padding reads as); ``weight``:
    :func:`depthwise_weight`'s; ``weight_sums``: each channel's int8 weight sum; ``multipliers`` and ``bias``:
    float32 per channel; ``requant``: its ``zx`` unused."""

    def __init__(self, shape: tuple[int, ...], padding: tuple[int, int], stride: int, zx: int, weight: torch.Tensor,
                 weight_sums: torch.Tensor, multipliers: torch.Tensor, bias: torch.Tensor,
                 requant: OnednnRequant) -> None:
        assert loader.loops is not None
        n, c, h, w = shape
        offset = (weight_sums.to(torch.int32) * zx).contiguous()
        self.tensors = (weight, offset, multipliers.float().contiguous(), bias.float().contiguous())
        self.geometry = (n, h, w, c, *padding, stride, zx)
        addresses = [t.data_ptr() for t in self.tensors]
        self.weights = (addresses[0], addresses[1], addresses[2], addresses[3])
        self.requant = requant
        self.out_size = ((h + 2 * padding[0] - 3) // stride + 1, (w + 2 * padding[1] - 3) // stride + 1)
        self.entry = extension.dwconv3x3_onednn

    def __call__(self, x: int, out: int) -> None:
        if not self.entry((x, *self.geometry), self.weights, self.requant, (out, *self.out_size)):
            raise RuntimeError("dwconv3x3_onednn: this CPU has no AVX2 (the caller checks isa.has_avx2 first)")

"""Typed wrapper of the Winograd 3x3 conv (``fxquant/native/csrc/winograd_avx2.c``): a 3x3 conv of stride 1 as
Winograd F(2x2, 3x3) in exact integers on AVX2, with oneDNN's requantization. Which layers take it, and why:
:mod:`fxquant.kernels.onednn.winograd` and docs/backends.md.
"""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.amx_gemm import OnednnRequant, padded
from fxquant.native.loader import extension

# (2G): F(2x2, 3x3)'s weight transform times 2, so that (2G) g (2G)^T is in integers (4x the usual one; the kernel's
# output transform divides the sums by 4 exactly)
_G2 = torch.tensor([[2, 0, 0], [1, 1, 1], [1, -1, 1], [0, 0, 2]], dtype=torch.int32)


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def transformed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The conv's int8 (K, C, 3, 3) ``weight`` as the kernel reads it: ``(2G) g (2G)^T`` per (output, input) pair,
    int16 (|u| <= 9 * 128), laid out (16 points, K16 / 16, C16 / 2, 16 outputs, 2 inputs), zeros past K and C."""
    out_channels, in_channels = weight.shape[:2]
    u = torch.einsum("pi,kcij,qj->pqkc", _G2, weight.to(torch.int32), _G2).reshape(16, out_channels, in_channels)
    k16, c16 = _round16(out_channels), _round16(in_channels)
    layout = torch.zeros(16, k16, c16, dtype=torch.int16)
    layout[:, :out_channels, :in_channels] = u.to(torch.int16)
    return layout.reshape(16, k16 // 16, 16, c16 // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


class OnednnWinograd:
    """``conv3x3_onednn`` for one input shape as ``run(x address, out address)`` (the output read first as the sum
    post-op's accumulator where ``accum`` is given); RuntimeError (nothing written) without AVX2. It holds the
    tensors whose addresses it passes, so a replay that keeps only ``run`` keeps them.

    ``shape``: the channels-last uint8 input's (N, C, H, W); ``padding``: (top/bottom, left/right); ``zx``: the input
    zero point the padding reads as; ``weight``: :func:`transformed_weight`'s; ``multipliers`` and ``bias``: float32
    per output channel (padded here); ``requant``: its ``zx`` unused; ``accum``: the sum post-op's (scale, zero
    point)."""

    def __init__(self, shape: tuple[int, ...], padding: tuple[int, int], zx: int, weight: torch.Tensor,
                 multipliers: torch.Tensor, bias: torch.Tensor, out_channels: int, requant: OnednnRequant,
                 accum: tuple[float, int] | None = None) -> None:
        assert loader.loops is not None
        n, c, h, w = shape
        k16 = weight.shape[1] * 16
        self.tensors = (weight, padded(multipliers, k16), padded(bias, k16))
        self.geometry = (n, h, w, c, *padding, zx)
        self.args = ((weight.data_ptr(), self.tensors[1].data_ptr(), self.tensors[2].data_ptr(), _round16(c), k16,
                      out_channels),
                     requant, (accum is not None, *(accum or (1.0, 0))))
        self.out_size = (h + 2 * padding[0] - 2, w + 2 * padding[1] - 2)
        self.entry = extension.conv3x3_onednn

    def __call__(self, x: int, out: int) -> None:
        if not self.entry((x, *self.geometry), *self.args, (out, *self.out_size)):
            raise RuntimeError("conv3x3_onednn: this CPU has no AVX2 (the caller checks isa.has_avx2 first)")


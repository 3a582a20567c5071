"""``unet_style``: a small U-Net, the zoo's encoder-decoder with ``torch.cat`` skips and ConvTranspose2d upsampling.

Concatenation joins tensors quantized with different scales, and transposed convolutions have their own weight
layout; both need handling the classification models never exercise.
"""

from __future__ import annotations

import torch
from torch import nn

from fxquant.errors import ConfigError
from fxquant.models._blocks import ConvBNAct, check_positive, randn_batch

INPUT_SHAPE = (3, 64, 64)


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(ConvBNAct(in_channels, out_channels), ConvBNAct(out_channels, out_channels))


class UNet(nn.Module):
    """``depth`` pooling steps down, the same number of transposed-conv steps up, a 1x1 conv to per-pixel logits."""

    def __init__(self, in_channels: int, out_channels: int, base: int, depth: int) -> None:
        super().__init__()
        widths = [base * 2**level for level in range(depth + 1)]
        self.encoders = nn.ModuleList([_double_conv(in_channels, widths[0])])
        self.encoders.extend(_double_conv(widths[level], widths[level + 1]) for level in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.upsamplers = nn.ModuleList(
            nn.ConvTranspose2d(widths[level + 1], widths[level], 2, stride=2) for level in reversed(range(depth))
        )
        self.decoders = nn.ModuleList(
            _double_conv(2 * widths[level], widths[level]) for level in reversed(range(depth))
        )
        self.head = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for index, encoder in enumerate(self.encoders):
            x = encoder(x if index == 0 else self.pool(x))
            skips.append(x)
        skips.pop()  # the bottleneck output is ``x`` itself, not a skip
        # Python-level loops over ModuleLists are unrolled by torch.fx: no data dependency.
        for upsample, decoder in zip(self.upsamplers, self.decoders, strict=True):
            x = decoder(torch.cat([skips.pop(), upsample(x)], dim=1))
        return self.head(x)


def unet_style(*, in_channels: int = INPUT_SHAPE[0], out_channels: int = 2, base: int = 16, depth: int = 3) -> UNet:
    """A random-init U-Net in eval mode; height and width must be multiples of ``2 ** depth``.

    >>> unet_style()(torch.randn(1, 3, 64, 64)).shape
    torch.Size([1, 2, 64, 64])
    """
    check_positive("unet_style", in_channels=in_channels, out_channels=out_channels, base=base)
    if depth < 1:
        raise ConfigError(f"unet_style: depth must be >= 1, got {depth!r}")
    return UNet(in_channels, out_channels, base, depth).eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

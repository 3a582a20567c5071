"""``mobilenetv2_style``: MobileNetV2 laid out like torchvision's (``features`` + ``classifier``), no torchvision.

Depthwise convolutions, ReLU6 and linear bottlenecks are what make MobileNetV2 hard to quantize per tensor, which
is why the benchmarks carry it next to ResNet-18.
"""

from __future__ import annotations

import torch
from torch import nn

from fxquant.models._blocks import (
    ConvBNAct,
    check_positive,
    init_weights,
    make_divisible,
    randn_batch,
    settle_batchnorm,
)

INPUT_SHAPE = (3, 224, 224)
# (expansion t, output channels c, repeats n, first stride s) from the MobileNetV2 paper, Table 2.
BlockSettings = tuple[tuple[int, int, int, int], ...]
PAPER_SETTINGS: BlockSettings = (
    (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)
)


class InvertedResidual(nn.Module):
    """1x1 expansion (skipped when t == 1), 3x3 depthwise, 1x1 linear projection; residual when shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = round(in_channels * expand_ratio)
        self.use_res_connect = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNAct(in_channels, hidden, 1, activation=nn.ReLU6))
        layers.append(ConvBNAct(hidden, hidden, 3, stride=stride, groups=hidden, activation=nn.ReLU6))
        layers.append(ConvBNAct(hidden, out_channels, 1, activation=None))
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A plain Python bool fixed at construction, so torch.fx traces either branch without a data dependency.
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0,
                 settings: BlockSettings = PAPER_SETTINGS) -> None:
        super().__init__()
        in_channels = make_divisible(32 * width_mult)
        self.last_channel = make_divisible(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [ConvBNAct(INPUT_SHAPE[0], in_channels, 3, stride=2, activation=nn.ReLU6)]
        for expand_ratio, channels, repeats, first_stride in settings:
            out_channels = make_divisible(channels * width_mult)
            for index in range(repeats):
                stride = first_stride if index == 0 else 1
                layers.append(InvertedResidual(in_channels, out_channels, stride, expand_ratio))
                in_channels = out_channels
        layers.append(ConvBNAct(in_channels, self.last_channel, 1, activation=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(self.last_channel, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenetv2_style(*, num_classes: int = 1000, width_mult: float = 1.0,
                      settings: BlockSettings = PAPER_SETTINGS) -> MobileNetV2:
    """A randomly initialised MobileNetV2 (3.5M parameters at width 1.0) in eval mode, for 3x224x224 input.

    ``settings`` lists the inverted-residual stages as (expansion, channels, repeats, first stride); the default is
    the paper's Table 2. A random full-depth MobileNetV2 is chaotic: its float output keeps only ~18 dB SQNR when
    its input carries 40 dB noise, so accuracy tests use a shallower stack.

    >>> mobilenetv2_style(num_classes=10, width_mult=0.5)(torch.randn(1, 3, 224, 224)).shape
    torch.Size([1, 10])
    """
    check_positive("mobilenetv2_style", num_classes=num_classes, width_mult=width_mult)
    model = MobileNetV2(num_classes, width_mult, settings)
    init_weights(model, linear_std=0.01)
    settle_batchnorm(model, INPUT_SHAPE)
    return model.eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

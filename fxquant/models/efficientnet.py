"""``efficientnet_style``: EfficientNet-B0 (MBConv with squeeze-excitation and SiLU), no torchvision.

It brings what ResNet and MobileNetV2 lack: SiLU/swish, 5x5 depthwise convs, and a sigmoid gate multiplied into
activations (squeeze-excitation), all of which need their own quantization handling.
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
# (expansion, kernel, first stride, output channels, repeats) for EfficientNet-B0 stages 2-8.
_B0_STAGES = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)


class SqueezeExcitation(nn.Module):
    """Global pool -> 1x1 reduce -> SiLU -> 1x1 expand -> sigmoid, then rescale the input channels by that gate."""

    def __init__(self, channels: int, squeeze_channels: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze_channels, 1)
        self.activation = nn.SiLU()
        self.fc2 = nn.Conv2d(squeeze_channels, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return x * scale


class MBConv(nn.Module):
    """Expand 1x1 (unless ratio 1), depthwise kxk, squeeze-excitation, project 1x1; residual when shapes match."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = in_channels * expand_ratio
        self.use_res_connect = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNAct(in_channels, hidden, 1, activation=nn.SiLU))
        layers += [
            ConvBNAct(hidden, hidden, kernel, stride=stride, groups=hidden, activation=nn.SiLU),
            SqueezeExcitation(hidden, max(1, in_channels // 4)),
            ConvBNAct(hidden, out_channels, 1, activation=None),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:  # fixed at construction: no data dependency for fx
            return x + self.block(x)
        return self.block(x)


class EfficientNet(nn.Module):
    def __init__(self, num_classes: int, width_mult: float, depth_mult: float) -> None:
        super().__init__()
        in_channels = make_divisible(32 * width_mult)
        layers: list[nn.Module] = [ConvBNAct(INPUT_SHAPE[0], in_channels, 3, stride=2, activation=nn.SiLU)]
        for expand_ratio, kernel, first_stride, channels, repeats in _B0_STAGES:
            out_channels = make_divisible(channels * width_mult)
            for index in range(max(1, round(repeats * depth_mult))):
                stride = first_stride if index == 0 else 1
                layers.append(MBConv(in_channels, out_channels, kernel, stride, expand_ratio))
                in_channels = out_channels
        head_channels = 4 * make_divisible(320 * width_mult)
        layers.append(ConvBNAct(in_channels, head_channels, 1, activation=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(head_channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def efficientnet_style(*, num_classes: int = 1000, width_mult: float = 1.0, depth_mult: float = 1.0) -> EfficientNet:
    """A randomly initialised EfficientNet (B0 at the default multipliers, 5.3M parameters) in eval mode.

    >>> efficientnet_style(num_classes=10, width_mult=0.5, depth_mult=0.5)(torch.randn(1, 3, 224, 224)).shape
    torch.Size([1, 10])
    """
    check_positive("efficientnet_style", num_classes=num_classes, width_mult=width_mult, depth_mult=depth_mult)
    model = EfficientNet(num_classes, width_mult, depth_mult)
    init_weights(model, linear_std=0.01)
    settle_batchnorm(model, INPUT_SHAPE)
    return model.eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

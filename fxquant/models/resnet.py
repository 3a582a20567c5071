"""``resnet18_style``: ResNet-18 laid out module for module like torchvision's, without importing torchvision.

The structure (names ``conv1``/``bn1``/``relu``/``layer1``.../``fc``, one ReLU module called twice per block, the
``out += identity`` residual) matches torchvision's so passes tuned on this model behave the same on the real one.
"""

from __future__ import annotations

import torch
from torch import nn

from fxquant.models._blocks import check_positive, init_weights, randn_batch, settle_batchnorm

INPUT_SHAPE = (3, 224, 224)
_STAGE_WIDTHS = (64, 128, 256, 512)
_BLOCKS_PER_STAGE = (2, 2, 2, 2)


class BasicBlock(nn.Module):
    """Two 3x3 conv-bn pairs and a residual; ``downsample`` (1x1 conv + bn) matches the identity's shape."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


def _stage(in_channels: int, out_channels: int, blocks: int, *, stride: int) -> nn.Sequential:
    """The first block changes width/resolution (and gets the downsample); the rest keep them."""
    rest = [BasicBlock(out_channels, out_channels) for _ in range(blocks - 1)]
    return nn.Sequential(BasicBlock(in_channels, out_channels, stride), *rest)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, bn, relu, 3x3/2 maxpool), four stages of BasicBlocks, global average pool, fc."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(INPUT_SHAPE[0], 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = _stage(64, _STAGE_WIDTHS[0], _BLOCKS_PER_STAGE[0], stride=1)
        self.layer2 = _stage(_STAGE_WIDTHS[0], _STAGE_WIDTHS[1], _BLOCKS_PER_STAGE[1], stride=2)
        self.layer3 = _stage(_STAGE_WIDTHS[1], _STAGE_WIDTHS[2], _BLOCKS_PER_STAGE[2], stride=2)
        self.layer4 = _stage(_STAGE_WIDTHS[2], _STAGE_WIDTHS[3], _BLOCKS_PER_STAGE[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(_STAGE_WIDTHS[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_style(*, num_classes: int = 1000, residual_gamma: float = 1.0) -> ResNet:
    """A randomly initialised ResNet-18 (11.7M parameters with 1000 classes) in eval mode, for 3x224x224 input.

    ``residual_gamma`` initialises the last BatchNorm scale of every residual branch (torchvision's
    ``zero_init_residual`` is 0). Trained ResNets have small values there; a random network with 1.0 is close to
    chaotic, amplifying any perturbation of its input (40 dB input noise comes out at ~36 dB), which makes accuracy
    tests measure the random weights rather than the quantizer.

    >>> resnet18_style(num_classes=10)(torch.randn(1, 3, 224, 224)).shape
    torch.Size([1, 10])
    """
    check_positive("resnet18_style", num_classes=num_classes)
    model = ResNet(num_classes)
    init_weights(model)
    for module in model.modules():
        if isinstance(module, BasicBlock):
            nn.init.constant_(module.bn2.weight, residual_gamma)
    settle_batchnorm(model, INPUT_SHAPE)
    return model.eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

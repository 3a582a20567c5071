"""``conv_bn_net``: one Conv-BN-ReLU-MaxPool stage and a classifier, the smallest conv model with a foldable BN."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from fxquant.models._blocks import check_positive, randn_batch

INPUT_SHAPE = (3, 32, 32)


def conv_bn_net(*, channels: int = 16, num_classes: int = 10) -> nn.Sequential:
    """Conv 3x3 (3->channels) -> BN -> ReLU -> MaxPool 2 -> Flatten -> Linear on 3x32x32 images.

    Named children (``conv``, ``bn``, ...) keep pass tests readable: they can assert on ``conv`` and ``bn`` by name.

    >>> conv_bn_net()(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """
    check_positive("conv_bn_net", channels=channels, num_classes=num_classes)
    height, width = INPUT_SHAPE[1] // 2, INPUT_SHAPE[2] // 2
    layers = OrderedDict(
        conv=nn.Conv2d(INPUT_SHAPE[0], channels, 3, padding=1),
        bn=nn.BatchNorm2d(channels),
        relu=nn.ReLU(),
        pool=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
        fc=nn.Linear(channels * height * width, num_classes),
    )
    return nn.Sequential(layers).eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

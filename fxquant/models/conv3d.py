"""``conv3d_net``: a small video/volume classifier, the zoo's Conv3d/BatchNorm3d/MaxPool3d workload."""

from __future__ import annotations

import torch
from torch import nn

from fxquant.models._blocks import check_positive, randn_batch

INPUT_SHAPE = (3, 8, 32, 32)  # (channels, frames, height, width)


def conv3d_net(*, num_classes: int = 10, in_channels: int = INPUT_SHAPE[0], channels: int = 16) -> nn.Sequential:
    """Two conv3d-bn-relu stages (the first followed by a 2x2x2 max pool), global average pool, linear.

    >>> conv3d_net()(torch.randn(2, 3, 8, 32, 32)).shape
    torch.Size([2, 10])
    """
    check_positive("conv3d_net", num_classes=num_classes, in_channels=in_channels, channels=channels)
    return nn.Sequential(
        nn.Conv3d(in_channels, channels, 3, padding=1),
        nn.BatchNorm3d(channels),
        nn.ReLU(),
        nn.MaxPool3d(2),
        nn.Conv3d(channels, 2 * channels, 3, padding=1),
        nn.BatchNorm3d(2 * channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, num_classes),
    ).eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

"""``audio1d_net``: an M5-style raw-waveform classifier, the zoo's Conv1d/BatchNorm1d/MaxPool1d workload."""

from __future__ import annotations

import torch
from torch import nn

from fxquant.models._blocks import check_positive, randn_batch

INPUT_SHAPE = (1, 16000)  # one second of 16 kHz mono audio


def _conv_stage(in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv1d(in_channels, out_channels, kernel, stride), nn.BatchNorm1d(out_channels), nn.ReLU(), nn.MaxPool1d(4)
    )


def audio1d_net(*, num_classes: int = 35, in_channels: int = INPUT_SHAPE[0], channels: int = 32) -> nn.Sequential:
    """A wide strided first conv (80 taps, stride 16) then three narrow conv stages, global average pool, linear.

    Global pooling makes the model accept any waveform length of at least ~8k samples.

    >>> audio1d_net()(torch.randn(2, 1, 16000)).shape
    torch.Size([2, 35])
    """
    check_positive("audio1d_net", num_classes=num_classes, in_channels=in_channels, channels=channels)
    return nn.Sequential(
        _conv_stage(in_channels, channels, 80, stride=16),
        _conv_stage(channels, channels, 3),
        _conv_stage(channels, 2 * channels, 3),
        _conv_stage(2 * channels, 2 * channels, 3),
        nn.AdaptiveAvgPool1d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, num_classes),
    ).eval()


def example_inputs(batch_size: int = 1, *, samples: int = INPUT_SHAPE[1], seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch((INPUT_SHAPE[0], samples), batch_size, seed)

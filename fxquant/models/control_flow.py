"""``control_flow_net``: a model whole-model ``torch.fx.symbolic_trace`` cannot trace, because of ONE submodule.

``DataDependentBlock`` branches on ``x.sum() > 0``; everything else is plain Conv/BN/Linear. It exercises partial
tracing: keep the offending submodule as a leaf (or run it in float) and quantize the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from fxquant.models._blocks import check_positive, randn_batch

INPUT_SHAPE = (3, 32, 32)


class DataDependentBlock(nn.Module):
    """Picks one of two convolutions from the sign of the input's sum: a branch no symbolic tracer can record."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.positive = nn.Conv2d(channels, channels, 3, padding=1)
        self.negative = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.positive(x)
        return self.negative(x)


class ControlFlowNet(nn.Module):
    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(INPUT_SHAPE[0], channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.gated = DataDependentBlock(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gated(self.relu(self.bn(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def control_flow_net(*, channels: int = 16, num_classes: int = 10) -> ControlFlowNet:
    """Conv-BN-ReLU stem, a ``DataDependentBlock``, global average pool, linear; in eval mode.

    >>> control_flow_net()(torch.randn(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """
    check_positive("control_flow_net", channels=channels, num_classes=num_classes)
    return ControlFlowNet(channels, num_classes).eval()


def example_inputs(batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch(INPUT_SHAPE, batch_size, seed)

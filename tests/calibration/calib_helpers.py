"""Small seeded models and data shared by the calibration tests (also imported by the torchrun worker)."""

from __future__ import annotations

import torch
from torch import nn

import fxquant
from fxquant.calibration import observers_of

SHAPE = (4, 3, 8, 8)
MIXED_OBSERVERS = {"conv1": "minmax", "fc": "minmax"}  # with activation="histogram": both families in one model


class TinyNet(nn.Module):
    """Conv-ReLU, Conv, pooling and a Linear: conv-layout and linear-layout observers in one small graph."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.conv2(self.relu(self.conv1(x))))))


def tiny_net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyNet().eval()


def batches(count: int = 12, seed: int = 1) -> list[torch.Tensor]:
    """Seeded batches of ``SHAPE`` whose scale changes from batch to batch (so histograms must grow)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*SHAPE, generator=generator) * (1 + i % 5) for i in range(count)]


def prepared_tiny(activation: str = "histogram", **overrides: str) -> torch.fx.GraphModule:
    """TinyNet prepared with ``activation``; ``overrides`` maps module paths to another observer name."""
    config = fxquant.QuantConfig(activation=activation,
                                 overrides={path: {"activation": name} for path, name in overrides.items()})
    return fxquant.prepare(tiny_net(), (torch.randn(*SHAPE),), config)


def observer_state(prepared: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.clone() for k, v in obs.state_dict().items()} for name, obs in observers_of(prepared).items()}


def assert_identical(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), f"{name}.{key}: {a[name][key]} != {b[name][key]}"


def odd_batches_wrong() -> list[torch.Tensor]:
    """``batches()`` with every odd-position batch of the wrong shape: with two ranks, only rank 1 fails."""
    return [b if i % 2 == 0 else torch.randn(4, 5, 8, 8) for i, b in enumerate(batches())]

"""Shared by the accuracy-budget search tests: a four-Linear MLP, its data, and synthetic metrics whose answer is
known (each layer costs a fixed amount while it runs a given way), so a test can say which trials must win."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fxquant.nn.fused import Fused

LAYERS = ("fc1", "fc2", "fc3", "fc4")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16)
        self.fc3, self.fc4 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc4(torch.relu(self.fc3(x)))


def mlp_data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=generator) for _ in range(4)]


def runs_as(model: nn.Module, path: str) -> str:
    """The class of the layer at ``path`` (inside a fused activation): ``QuantizedLinear`` (static INT8),
    ``WeightOnlyInt8Linear``, ``DynamicInt8Linear``, or ``Linear`` (float)."""
    module = model.get_submodule(path)
    return type(module.inner if isinstance(module, Fused) else module).__name__


def synthetic_loss(costs: dict[str, float], *, when: str = "QuantizedLinear", base: float = 1.0
                   ) -> Callable[[nn.Module], float]:
    """Lower is better: ``base`` plus the cost of every layer that runs as ``when`` (default: static INT8)."""
    return lambda model: base + sum(cost for path, cost in costs.items() if runs_as(model, path) == when)

"""Float modules that the fuse pass builds: a Linear/Conv and the activation that follows it, as one unit.

Fusing before observers are inserted means the output observer sees the activation's (clamped) range, and the
int8 kernel applies the activation for free (ReLU as a post-op; a clamp at 6 by saturating at the observed range).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

COMPUTE_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
                                               nn.ConvTranspose2d)


class Fused(nn.Module):
    """``clamp(inner(x), min_val, max_val)``; ``min_val`` is 0 for ReLU/ReLU6, ``max_val`` None for ReLU."""

    def __init__(self, inner: nn.Module, min_val: float, max_val: float | None, activation: str) -> None:
        super().__init__()
        self.inner = inner
        self.min_val = min_val
        self.max_val = max_val
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.inner(x), self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


def add_relu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``relu(a + b)``: the residual join the fuse pass forms so the int8 add applies the ReLU."""
    return torch.relu(a + b)


def is_plain_layer(module: nn.Module) -> bool:
    """A Linear/Conv that computes exactly what its torch class computes: the class itself, or the subclass
    ``torch.nn.utils.parametrize`` makes for a reparametrized weight (``weight_norm``: Wav2Vec2's positional conv),
    whose ``forward`` is the class's own and whose ``weight`` is computed on access."""
    if type(module) in COMPUTE_TYPES:
        return True
    base = next((t for t in COMPUTE_TYPES if isinstance(module, t)), None)
    return base is not None and parametrize.is_parametrized(module, "weight") and type(module).forward is base.forward


def compute_module(m: nn.Module) -> nn.Linear | nn.modules.conv._ConvNd | None:
    """The Linear/Conv inside ``m`` if ``m`` is one (plain or fused), else None."""
    inner = m.inner if isinstance(m, Fused) else m
    if is_plain_layer(inner):
        assert isinstance(inner, (nn.Linear, nn.modules.conv._ConvNd))
        return inner
    return None

"""``mlp``: a Linear+ReLU stack, the smallest model the pipeline and benchmarks run ("MLP 3x1024")."""

from __future__ import annotations

import torch
from torch import nn

from fxquant.errors import ConfigError
from fxquant.models._blocks import check_positive, randn_batch

INPUT_SHAPE = (1024,)


def mlp(*, in_features: int = 1024, hidden: int = 1024, out_features: int = 1024, layers: int = 3) -> nn.Sequential:
    """``layers`` Linear layers with a ReLU between consecutive ones; the last Linear gives raw outputs (logits).

    >>> mlp(layers=2)(torch.randn(4, 1024)).shape
    torch.Size([4, 1024])
    """
    check_positive("mlp", in_features=in_features, hidden=hidden, out_features=out_features)
    if layers < 1:
        raise ConfigError(f"mlp: layers must be >= 1, got {layers!r}")
    widths = [in_features] + [hidden] * (layers - 1) + [out_features]
    modules: list[nn.Module] = []
    for index in range(layers):
        modules.append(nn.Linear(widths[index], widths[index + 1]))
        if index < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules).eval()


def example_inputs(batch_size: int = 1, *, in_features: int = INPUT_SHAPE[0], seed: int = 0) -> tuple[torch.Tensor]:
    return randn_batch((in_features,), batch_size, seed)

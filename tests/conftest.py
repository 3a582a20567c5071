"""Shared fixtures: small seeded models and data from the zoo."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.kernels.registry import available_backends


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def calibrated(model: torch.nn.Module, shape: tuple[int, ...], config: fxquant.QuantConfig | None = None,
               batches: int = 4) -> torch.fx.GraphModule:
    """A prepared and calibrated copy of ``model`` on random batches of ``shape``."""
    data = [torch.randn(*shape) for _ in range(batches)]
    prepared = fxquant.prepare(model, (data[0],), config)
    fxquant.calibrate(prepared, data, progress=False)
    return prepared


QUANTIZED_DTYPE_BACKENDS = [b for b in ("fbgemm", "qnnpack") if b in available_backends()]

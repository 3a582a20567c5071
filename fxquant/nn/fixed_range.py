"""INT8 sigmoid, hardsigmoid and tanh: bounded functions whose output qparams come from their range, not from data.

Squeeze-excitation gates (``x * sigmoid(fc(pool(x)))``) then stay int8 from the conv before them into the multiply,
as in torch.ao, instead of leaving int8 for the gate and entering it again after the product.
"""

from __future__ import annotations

import torch

from fxquant.kernels.base import Backend
from fxquant.nn.quantized import _BackendModule
from fxquant.qparams import QParams


class QuantizedFixedRange(_BackendModule):
    """``function`` ("sigmoid", "hardsigmoid", "tanh") of an int8 value, at the fixed output qparams ``qout``."""

    def __init__(self, function: str, qa: QParams, qout: QParams, backend: Backend) -> None:
        super().__init__(backend)
        self.function, self.qa, self.out_qp = function, qa, qout

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.backend.fixed_range(a, self.function, self.qa, self.out_qp)

    def extra_repr(self) -> str:
        scale, zp = self.out_qp.scalar()
        return f"{self.function}, scale={scale:.4g}, zero_point={zp}, backend={self.backend.name}"

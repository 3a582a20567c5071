"""The one interface every INT8 kernel backend implements.

fxquant owns the quantization parameters (:class:`~fxquant.qparams.QParams`); a backend only decides how an int8
activation is represented at run time (a quantized-dtype tensor for fbgemm/qnnpack, a plain ``torch.uint8`` tensor
for oneDNN and the reference backend) and which kernels compute on it. Because qparams are fxquant's own, a
converted model can be re-lowered to another backend without recalibrating.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fxquant.qparams import UINT8_RANGE, QParams


@dataclass(frozen=True)
class ConvSpec:
    """The geometry of a convolution, as ``nn.ConvNd`` stores it (tuples of length ``dim``)."""

    dim: int
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    @property
    def depthwise_like(self) -> bool:
        return self.groups > 1


@dataclass
class PackedWeight:
    """Backend-specific prepacked weights plus the backend that packed them (packing is engine-bound)."""

    backend: str
    payload: Any


class Backend(ABC):
    """An implementation of int8 linear/conv/add and the activation conversions around them.

    Activations handed to and returned by a backend are opaque to the rest of fxquant: only the backend that
    produced them (and the structural ops that work on any tensor: view, flatten, max-pool, ...) touch them.
    """

    name: ClassVar[str] = ""

    def __deepcopy__(self, memo: dict[int, Any]) -> Backend:
        return self  # backends are stateless shared instances; copying a model must not copy them

    @classmethod
    def is_available(cls) -> bool:
        """Whether this torch build and CPU can run the backend."""
        return True

    def activation_qrange(self, *, feeds_grouped_conv: bool) -> tuple[int, int]:
        """The integer range activations should use, given what consumes them."""
        return UINT8_RANGE

    @abstractmethod
    def quantize(self, x: torch.Tensor, qp: QParams) -> torch.Tensor: ...

    @abstractmethod
    def dequantize(self, a: torch.Tensor, qp: QParams) -> torch.Tensor: ...

    @abstractmethod
    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None) -> PackedWeight:
        """``weight`` is the int8 weight (plain ``torch.int8``), ``w_qp`` its symmetric qparams."""

    @abstractmethod
    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor: ...

    @abstractmethod
    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight: ...

    @abstractmethod
    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor: ...

    @abstractmethod
    def add(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams, *,
            relu: bool) -> torch.Tensor: ...

    @abstractmethod
    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        """ReLU on an int8 activation; the output keeps ``qp``."""

    @abstractmethod
    def adaptive_avg_pool(self, a: torch.Tensor, qp: QParams, output_size: Any) -> torch.Tensor:
        """Adaptive average pooling (any dim); the output keeps ``qp``."""

    @abstractmethod
    def avg_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        """``F.avg_poolNd(a, **kwargs)``; the output keeps ``qp``."""

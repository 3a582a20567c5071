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
from fxquant.qparams import dequantize as dequantize_weight


@dataclass(frozen=True)
class ConvSpec:
    """The geometry of a convolution, as ``nn.ConvNd`` stores it (tuples of length ``dim``)."""

    dim: int
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transposed: bool = False
    output_padding: tuple[int, ...] = ()

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
    fallback: ClassVar[str | None] = None  # a backend with the same activation representation, for missing kernels
    int32_accumulator: ClassVar[bool] = True  # sums int8 products in int32: layers that could overflow are refused
    int32_bias: ClassVar[bool] = False  # adds the bias rounded to int32 at scale s_x * s_w (not as a float)
    # Average pools round a mean half to even: of ``q - zero_point`` (False), or of the stored ``q`` (True: torch's
    # quantized kernels); the two differ on exact ties (a quarter of 2x2 means) when the zero point is odd.
    pool_rounds_stored_integers: ClassVar[bool] = False

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

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        """``F.max_poolNd(a, **kwargs)``: order-preserving, so it runs on the integers (1-d through the 2-d kernel,
        which, unlike the 1-d one, accepts uint8)."""
        if dim == 1:
            options: dict[str, Any] = dict(kwargs)
            options["stride"] = options.get("stride") or options["kernel_size"]
            for key, neutral in (("kernel_size", 1), ("stride", 1), ("padding", 0), ("dilation", 1)):
                if key in options:
                    value = options[key]
                    options[key] = (neutral, value if isinstance(value, int) else value[0])
            return torch.nn.functional.max_pool2d(a.unsqueeze(-2), **options).squeeze(-2)
        fn = torch.nn.functional.max_pool2d if dim == 2 else torch.nn.functional.max_pool3d
        return fn(a, **kwargs)

    def mul(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams) -> torch.Tensor:
        """Element-wise product; this default computes in float between a dequantize and a quantize."""
        return self.quantize(self.dequantize(a, qa) * self.dequantize(b, qb), qout)

    def cat(self, values: list[torch.Tensor], qps: list[QParams], qout: QParams, dim: int) -> torch.Tensor:
        """Concatenation requantized to ``qout``; this default goes through float."""
        return self.quantize(torch.cat([self.dequantize(v, qp) for v, qp in zip(values, qps, strict=True)], dim), qout)

    def prepack_conv_transpose(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                               spec: ConvSpec) -> PackedWeight:
        """Transposed convolutions; this default keeps the dequantized weight for a float computation."""
        return PackedWeight(self.name, (spec, dequantize_weight(weight, w_qp), bias))

    def conv_transpose(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams) -> torch.Tensor:
        spec, weight, bias = packed.payload
        fn = torch.nn.functional.conv_transpose1d if spec.dim == 1 else torch.nn.functional.conv_transpose2d
        out = fn(self.dequantize(a, in_qp), weight, bias, spec.stride, spec.padding, spec.output_padding,
                 spec.groups, spec.dilation)
        return self.quantize(out, out_qp)

    @abstractmethod
    def avg_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        """``F.avg_poolNd(a, **kwargs)``; the output keeps ``qp``."""

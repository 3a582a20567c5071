"""The one interface every INT8 kernel backend implements.

fxquant owns the quantization parameters (:class:`~fxquant.qparams.QParams`); a backend only decides how an int8
activation is represented at run time (a quantized-dtype tensor for fbgemm/qnnpack, a plain ``torch.uint8`` tensor
for oneDNN and the reference backend) and which kernels compute on it. Because qparams are fxquant's own, a
converted model can be re-lowered to another backend without recalibrating.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fxquant import native
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


@dataclass(frozen=True)
class ConvAddQParams:
    """The qparams of ``conv(a) + accum``: the conv's input, the conv's own output (what a backend that runs the add
    separately requantizes to), the other addend and the sum."""

    input: QParams
    conv: QParams
    accum: QParams
    out: QParams


def same_grid(a: QParams, b: QParams) -> bool:
    """Whether two per-tensor qparams describe the same integers (scale, zero point and range)."""
    return a is b or (a.scalar() == b.scalar() and (a.qmin, a.qmax) == (b.qmin, b.qmax))


# Float functions a Linear/Conv can apply to its float result before rounding to the next int8 value, by name
# (``Backend.linear_unary``): EfficientNet's SiLU, MobileNetV3's hardswish, BERT's GELU.
UNARY_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
}


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
    # Whether ``conv_add`` runs conv and add as one kernel (one rounding, no int8 round trip between them): convert
    # fuses a conv into the add it feeds only then; other backends keep their own add kernel.
    fuses_conv_add: ClassVar[bool] = False
    # Whether ``linear_to_float`` (``conv_to_float``) returns the layer's float result unrounded (Inductor's float
    # output): convert then drops the dequantize after a Linear (Conv) whose only user is float code (BERT's q/k/v
    # and GELU inputs, the FFN output feeding a float residual add).
    fuses_float_output: ClassVar[bool] = False
    fuses_float_conv_output: ClassVar[bool] = False
    # The ``UNARY_FUNCTIONS`` a Linear (Conv) kernel applies to its float result before the one rounding to the
    # output: convert folds ``quantize(f(layer(x)))`` into one ``linear_unary`` (``conv_unary``) call only for these.
    fused_linear_unary: ClassVar[frozenset[str]] = frozenset()
    fused_conv_unary: ClassVar[frozenset[str]] = frozenset()

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
    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, *,
                       in_qp: QParams | None = None) -> PackedWeight:
        """``weight`` is the int8 weight (plain ``torch.int8``), ``w_qp`` its symmetric qparams; ``in_qp``, where
        known, the qparams of the inputs the layer will be called with (a backend may fold their zero point into
        the bias; calls with other qparams must still be right)."""

    @abstractmethod
    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor: ...

    def holds_weight(self, packed: PackedWeight) -> bool:
        """Whether ``packed`` holds the only int8 copy of the weight its layer needs: the layer then keeps none of
        its own and reads it back with :meth:`unpacked_weight` (oneDNN's Linears)."""
        return False

    def unpacked_weight(self, packed: PackedWeight) -> torch.Tensor:
        """The plain int8 weight held by ``packed`` (where :meth:`holds_weight`), a new tensor on each call."""
        raise NotImplementedError(f"the {self.name} backend keeps no weight of its own")

    def unpacked_rows(self, packed: PackedWeight, outputs: torch.Tensor) -> torch.Tensor:
        """The int8 rows of the outputs ``outputs`` (1-d indices) of the weight held by ``packed``."""
        return self.unpacked_weight(packed).index_select(0, outputs)

    @abstractmethod
    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight: ...

    @abstractmethod
    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor: ...

    @abstractmethod
    def add(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams, *,
            relu: bool) -> torch.Tensor: ...

    def linear_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                        relu: bool) -> torch.Tensor:
        """A Linear whose output only feeds float code, as a float tensor. This default rounds it to ``out_qp``
        and dequantizes; backends with ``fuses_float_output`` skip the rounding."""
        return self.dequantize(self.linear(a, packed, in_qp, out_qp, relu=relu), out_qp)

    def conv_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                      relu: bool) -> torch.Tensor:
        """``linear_to_float`` for a Conv (same default: round to ``out_qp``, then dequantize)."""
        return self.dequantize(self.conv(a, packed, in_qp, out_qp, relu=relu), out_qp)

    def linear_unary(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, unary: str,
                     unary_qp: QParams) -> torch.Tensor:
        """``UNARY_FUNCTIONS[unary]`` of the Linear's result, quantized to ``unary_qp``; ``out_qp`` is the Linear's
        own output qparams. This default is the unfused sequence: ``linear_to_float``, the function, a quantize."""
        return self.quantize(UNARY_FUNCTIONS[unary](self.linear_to_float(a, packed, in_qp, out_qp, relu=False)),
                             unary_qp)

    def conv_unary(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, unary: str,
                   unary_qp: QParams) -> torch.Tensor:
        """``linear_unary`` for a Conv."""
        return self.quantize(UNARY_FUNCTIONS[unary](self.conv_to_float(a, packed, in_qp, out_qp, relu=False)),
                             unary_qp)

    def conv_add(self, a: torch.Tensor, packed: PackedWeight, accum: torch.Tensor, qps: ConvAddQParams, *,
                 relu: bool) -> torch.Tensor:
        """``conv(a) + accum`` (then ReLU) requantized to ``qps.out``; the residual join of ResNet-like blocks.

        A fusing backend may overwrite ``accum`` (oneDNN sums into it in place): callers pass a tensor nothing reads
        afterwards. This default requantizes the conv output to ``qps.conv`` first, then adds.
        """
        conv_out = self.conv(a, packed, qps.input, qps.conv, relu=False)
        return self.add(conv_out, accum, qps.conv, qps.accum, qps.out, relu=relu)

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

    def fixed_range(self, a: torch.Tensor, function: str, qa: QParams, qout: QParams) -> torch.Tensor:
        """``function`` ("sigmoid", "hardsigmoid" or "tanh") of an int8 value, quantized to ``qout`` (the qparams of
        the function's range); this default computes in float between a dequantize and a quantize."""
        functions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardsigmoid": torch.nn.functional.hardsigmoid}
        return self.quantize(functions[function](self.dequantize(a, qa)), qout)

    @abstractmethod
    def from_bytes(self, stored: torch.Tensor, qp: QParams) -> torch.Tensor:
        """This backend's int8 value at ``qp`` whose stored bytes are ``stored`` (uint8)."""

    @abstractmethod
    def to_bytes(self, a: torch.Tensor) -> torch.Tensor:
        """The stored bytes of int8 value ``a`` as uint8."""

    def lookup_table(self, function: Callable[[torch.Tensor], torch.Tensor], qa: QParams,
                     qout: QParams) -> torch.Tensor:
        """uint8[256]: entry ``b`` is the byte this backend stores for ``function`` of the input stored as ``b`` --
        its own dequantize, ``function`` and quantize, run once on every possible byte (:mod:`fxquant.nn.lookup`)."""
        with torch.no_grad():
            levels = self.from_bytes(torch.arange(256, dtype=torch.uint8), qa)
            return self.to_bytes(self.quantize(function(self.dequantize(levels, qa)), qout)).contiguous()

    @abstractmethod
    def lookup(self, a: torch.Tensor, table: torch.Tensor, qout: QParams) -> torch.Tensor:
        """``table`` (from ``lookup_table``) applied to every stored byte of ``a``: an int8 value at ``qout``."""

    def cat(self, values: list[torch.Tensor], qps: list[QParams], qout: QParams, dim: int) -> torch.Tensor:
        """Concatenation requantized to ``qout``; this default goes through float, unless every input is on
        ``qout``'s grid already (convert gives a cat's inputs its qparams where it can): then it is a copy."""
        if all(same_grid(qp, qout) for qp in qps):
            out = native.concat(values, dim, lambda shape: torch.empty(shape, dtype=values[0].dtype))
            return torch.cat(values, dim) if out is None else out
        return self.quantize(torch.cat([self.dequantize(v, qp) for v, qp in zip(values, qps, strict=True)], dim), qout)

    def prepack_conv_transpose(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                               spec: ConvSpec, *, in_qp: QParams | None = None) -> PackedWeight:
        """Transposed convolutions; this default keeps the dequantized weight for a float computation. ``in_qp``:
        as for ``prepack_linear``."""
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

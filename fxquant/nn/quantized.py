"""INT8 modules that ``convert`` puts in place of float Linear/Conv/add/ReLU/pool nodes.

Each module keeps its int8 weight, scales and zero points as plain tensors (fxquant's own qparams) and hands the
arithmetic to a :class:`~fxquant.kernels.base.Backend`. ``relower(backend)`` re-prepacks for another backend without
recalibration.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fxquant.kernels.base import Backend, ConvAddQParams, ConvSpec, PackedWeight
from fxquant.qparams import QParams, dequantize

_GENERATIONS = itertools.count()


class _BackendModule(nn.Module):
    """A module whose forward runs on a backend; ``relower`` switches the backend.

    ``generation`` takes a new value whenever an attribute is set or deleted (qparams, packed weights, buffers, the
    backend): a run replayed from a recording (:mod:`fxquant.runtime.replay`) compares it on every call, where
    comparing every attribute would cost more than the layer's kernel at batch 1.
    """

    generation: int

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self.backend = backend

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        object.__setattr__(self, "generation", next(_GENERATIONS))

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        object.__setattr__(self, "generation", next(_GENERATIONS))

    def relower(self, backend: Backend) -> None:
        self.backend = backend

    def extra_repr(self) -> str:
        return f"backend={self.backend.name}"


class Quantize(_BackendModule):
    """Float -> int8 where a float value enters an int8 region."""

    def __init__(self, qp: QParams, backend: Backend) -> None:
        super().__init__(backend)
        self.qp = qp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.quantize(x, self.qp)

    def extra_repr(self) -> str:
        scale, zp = self.qp.scalar()
        return f"scale={scale:.4g}, zero_point={zp}, {super().extra_repr()}"


class DeQuantize(_BackendModule):
    """Int8 -> float where an int8 value leaves the int8 region."""

    def __init__(self, qp: QParams, backend: Backend) -> None:
        super().__init__(backend)
        self.qp = qp

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.backend.dequantize(a, self.qp)


class _QuantizedWeighted(_BackendModule):
    """Shared state of quantized Linear/Conv: int8 weight, its qparams, float bias, input/output qparams.

    The int8 ``weight`` is a buffer, except where the backend's packed weight holds the only copy the layer needs
    (``Backend.holds_weight``: a Linear on oneDNN's primitives, whose weight lies in oneDNN's layout): a second,
    plain copy would double the layer's int8 bytes. ``weight`` then reads it back (a new tensor on each access), and
    ``state_dict`` and ``load_state_dict`` still have it under the same key."""

    _packed: PackedWeight
    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor
    bias: torch.Tensor | None
    # A fused ReLU6/hardtanh is applied by saturating at the output qparams' range (the observer saw the clamped
    # values): such an output must be rounded to them, never returned unrounded or summed into a fused add.
    range_clamp: bool = False

    def __init__(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, io: tuple[QParams, QParams],
                 *, relu: bool, backend: Backend) -> None:
        super().__init__(backend)
        self.weight_shape = tuple(weight.shape)  # (the weight may be read back from the packed copy: not for this)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", w_qp.scale)
        self.register_buffer("weight_zero_point", w_qp.zero_point)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.w_qp = w_qp
        self.in_qp, self.out_qp = io
        self.relu = relu
        # Set by convert where the layer's float result only feeds a float function whose result is quantized
        # (``Backend.fused_linear_unary``): the layer then returns ``quantize(f(result), unary_qp)``.
        self.unary: str | None = None
        self.unary_qp: QParams | None = None
        self.relower(backend)

    def __getattr__(self, name: str) -> Any:
        # ``weight`` where no buffer (nor attribute) has it: read back from the packed weight that holds it
        if name == "weight" and "weight" not in self._buffers and self._held():
            return self.backend.unpacked_weight(self._packed)
        return super().__getattr__(name)

    def _held(self) -> bool:
        """Whether the packed weight holds the only copy (no buffer: an export's copy moves its buffers out too)."""
        packed = self.__dict__.get("_packed")  # (none yet while __init__ registers the buffers)
        return packed is not None and self.backend.holds_weight(packed)

    def _pack(self, backend: Backend, pack: Callable[[torch.Tensor], PackedWeight]) -> None:
        """Switch to ``backend`` with the weight ``pack`` packs for it; the buffer goes where the packed weight holds
        the only copy, and comes back where it does not."""
        weight = self.weight  # read before the backend changes: the old packed weight may hold it
        super().relower(backend)
        self._packed = pack(weight)
        if backend.holds_weight(self._packed):
            self._buffers.pop("weight", None)
        else:
            self._buffers["weight"] = weight

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self._held():
            destination[prefix + "weight"] = self.weight  # first, where the buffer would be
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        if self._held():
            self._buffers["weight"] = self.weight
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        # packed again from the loaded weight, scales and bias: the packed weight and the kernels' own copies (oneDNN's
        # primitives, fbgemm's packing) hold the old ones
        self.relower(self.backend)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.weight, self.w_qp)

    def extra_repr(self) -> str:
        scale, zp = self.out_qp.scalar()
        per = "per_channel" if self.w_qp.per_channel else "per_tensor"
        unary = f", then {self.unary} to {self.unary_qp.scalar()}" if self.unary and self.unary_qp else ""
        return (f"{self.weight_shape}, weight={per}, relu={self.relu}, scale={scale:.4g}, "
                f"zero_point={zp}{unary}, backend={self.backend.name}")


class QuantizedLinear(_QuantizedWeighted):
    """INT8 ``nn.Linear`` (optionally fused with ReLU). With ``float_output`` (set by convert where only float code
    reads it) it returns a float tensor: ``Backend.linear_to_float``."""

    float_output: bool = False
    scheme = "static"

    @property
    def out_features(self) -> int:
        return self.weight_shape[0]

    @property
    def in_features(self) -> int:
        return self.weight_shape[1]

    def weight_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """The rows of :meth:`dequantized_weight` of the outputs ``outputs`` (indices of any shape), made from those
        rows alone (as :meth:`fxquant.nn.schemes.SchemeLinear.weight_rows`; ``IndexError`` outside the weight)."""
        flat = outputs.reshape(-1)
        qp = self.w_qp
        if qp.per_channel:
            qp = replace(qp, scale=qp.scale.index_select(0, flat), zero_point=qp.zero_point.index_select(0, flat))
        # read back by rows where the packed weight holds it, not the whole weight
        rows = self.backend.unpacked_rows(self._packed, flat) if self._held() else self.weight.index_select(0, flat)
        return dequantize(rows, qp).view(*outputs.shape, self.in_features)

    def relower(self, backend: Backend) -> None:
        self._pack(backend, lambda weight: backend.prepack_linear(weight, self.w_qp, self.bias, in_qp=self.in_qp))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.unary is not None and self.unary_qp is not None:
            return self.backend.linear_unary(a, self._packed, self.in_qp, self.out_qp, self.unary, self.unary_qp)
        if self.float_output:
            return self.backend.linear_to_float(a, self._packed, self.in_qp, self.out_qp, relu=self.relu)
        return self.backend.linear(a, self._packed, self.in_qp, self.out_qp, relu=self.relu)


class _QuantizedConvBase(_QuantizedWeighted):
    """Quantized Linear state plus the convolution's geometry (needed before ``relower`` prepacks)."""

    def __init__(self, spec: ConvSpec, *args: Any, **kwargs: Any) -> None:
        self.spec = spec
        super().__init__(*args, **kwargs)


class QuantizedConvNd(_QuantizedConvBase):
    """INT8 ``nn.ConvNd`` (optionally fused with ReLU); ``float_output`` as for :class:`QuantizedLinear`."""

    float_output: bool = False

    def relower(self, backend: Backend) -> None:
        self._pack(backend, lambda weight: backend.prepack_conv(weight, self.w_qp, self.bias, self.spec,
                                                                in_qp=self.in_qp))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.unary is not None and self.unary_qp is not None:
            return self.backend.conv_unary(a, self._packed, self.in_qp, self.out_qp, self.unary, self.unary_qp)
        if self.float_output:
            return self.backend.conv_to_float(a, self._packed, self.in_qp, self.out_qp, relu=self.relu)
        return self.backend.conv(a, self._packed, self.in_qp, self.out_qp, relu=self.relu)


class QuantizedConvTransposeNd(_QuantizedConvBase):
    """INT8 ``nn.ConvTransposeNd`` (weights per tensor: no kernel takes per-channel transposed weights)."""

    def relower(self, backend: Backend) -> None:
        self._pack(backend, lambda weight: backend.prepack_conv_transpose(weight, self.w_qp, self.bias, self.spec,
                                                                          in_qp=self.in_qp))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        out = self.backend.conv_transpose(a, self._packed, self.in_qp, self.out_qp)
        return self.backend.relu(out, self.out_qp) if self.relu else out


class QuantizedConvTranspose1d(QuantizedConvTransposeNd):
    """INT8 ``nn.ConvTranspose1d``."""


class QuantizedConvTranspose2d(QuantizedConvTransposeNd):
    """INT8 ``nn.ConvTranspose2d``."""


class QuantizedConv1d(QuantizedConvNd):
    """INT8 ``nn.Conv1d``."""


class QuantizedConv2d(QuantizedConvNd):
    """INT8 ``nn.Conv2d``."""


class QuantizedConv3d(QuantizedConvNd):
    """INT8 ``nn.Conv3d``."""


class QuantizedConvAdd2d(QuantizedConv2d):
    """INT8 ``conv2d(a) + accum`` (optionally then ReLU): a Conv2d whose only user was a residual add, run as one
    kernel where the backend has one (``Backend.fuses_conv_add``), else as its conv then its add.

    It sits at the conv's module path and keeps the conv's own output qparams, so called with one input it is that
    Conv2d alone (per-layer reports and ``auto`` time and compare the layer by itself).
    """

    def __init__(self, conv: QuantizedConvNd, add_qparams: tuple[QParams, QParams], *, relu: bool,
                 clone_accum: bool) -> None:
        assert not conv.relu, "a conv with a fused ReLU does not feed an add directly"
        super().__init__(conv.spec, conv.weight, conv.w_qp, conv.bias, (conv.in_qp, conv.out_qp), relu=conv.relu,
                         backend=conv.backend)
        accum_qp, sum_qp = add_qparams
        self.qps = ConvAddQParams(conv.in_qp, conv.out_qp, accum_qp, sum_qp)
        self.add_relu = relu
        self.clone_accum = clone_accum  # the fused kernel may write into accum: copy it when something reads it later

    def forward(self, a: torch.Tensor, accum: torch.Tensor | None = None) -> torch.Tensor:
        if accum is None:
            return super().forward(a)
        if self.clone_accum:
            accum = accum.clone()
        return self.backend.conv_add(a, self._packed, accum, self.qps, relu=self.add_relu)

    def extra_repr(self) -> str:
        scale, zp = self.qps.out.scalar()
        copy = ", clone_accum=True" if self.clone_accum else ""
        return f"{super().extra_repr()}, add_relu={self.add_relu}, sum_scale={scale:.4g}, sum_zero_point={zp}{copy}"


class QuantizedAdd(_BackendModule):
    """INT8 residual add (optionally fused with ReLU); inputs may have different scales."""

    def __init__(self, qa: QParams, qb: QParams, qout: QParams, *, relu: bool, backend: Backend) -> None:
        super().__init__(backend)
        self.qa, self.qb, self.out_qp, self.relu = qa, qb, qout, relu

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.backend.add(a, b, self.qa, self.qb, self.out_qp, relu=self.relu)


class QuantizedMul(_BackendModule):
    """INT8 element-wise product of two int8 values."""

    def __init__(self, qa: QParams, qb: QParams, qout: QParams, *, backend: Backend) -> None:
        super().__init__(backend)
        self.qa, self.qb, self.out_qp = qa, qb, qout

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.backend.mul(a, b, self.qa, self.qb, self.out_qp)


class QuantizedCat(_BackendModule):
    """Concatenation of int8 values, requantized to one output scale (U-Net skips, Inception branches)."""

    def __init__(self, qps: list[QParams], qout: QParams, *, dim: int, backend: Backend) -> None:
        super().__init__(backend)
        self.qps, self.out_qp, self.dim = qps, qout, dim

    def forward(self, values: list[torch.Tensor]) -> torch.Tensor:
        return self.backend.cat(list(values), self.qps, self.out_qp, self.dim)


class QuantizedReLU(_BackendModule):
    """ReLU on an int8 value: the output keeps the input's qparams."""

    def __init__(self, qp: QParams, backend: Backend) -> None:
        super().__init__(backend)
        self.qp = qp

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.backend.relu(a, self.qp)


class QuantizedPool(_BackendModule):
    """Max, average or adaptive-average pooling on an int8 value: the output keeps the input's qparams."""

    def __init__(self, qp: QParams, backend: Backend, *, kind: str, dim: int, options: dict[str, Any]) -> None:
        super().__init__(backend)
        self.qp, self.kind, self.dim, self.options = qp, kind, dim, options

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if self.kind == "adaptive_avg":
            return self.backend.adaptive_avg_pool(a, self.qp, self.options["output_size"])
        if self.kind == "max":
            return self.backend.max_pool(a, self.qp, self.dim, self.options)
        return self.backend.avg_pool(a, self.qp, self.dim, self.options)

    def extra_repr(self) -> str:
        return f"{self.kind}, dim={self.dim}, {self.options}, backend={self.backend.name}"


QUANTIZED_CONV = {1: QuantizedConv1d, 2: QuantizedConv2d, 3: QuantizedConv3d}
QUANTIZED_CONV_TRANSPOSE = {1: QuantizedConvTranspose1d, 2: QuantizedConvTranspose2d}

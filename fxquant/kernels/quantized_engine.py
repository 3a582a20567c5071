"""fbgemm and qnnpack: ``torch.ops.quantized`` kernels on quantized-dtype tensors.

This is the only module of fxquant that touches the quantized dtypes (``quint8``/``qint8``) and the process-wide
``torch.backends.quantized.engine``. torch 2.13 deprecates those dtypes (pytorch issue 184982); users of these two
backends are told once, and torch's per-call warning is silenced. The engine is switched only while weights are
prepacked (a packed weight remembers its engine), then restored.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from fxquant.cpu import has_vnni
from fxquant.kernels.base import Backend, ConvSpec, PackedWeight
from fxquant.kernels.registry import register_backend
from fxquant.qparams import REDUCED_UINT8_RANGE, UINT8_RANGE, QParams

log = logging.getLogger(__name__)
_TOLD = False
_DEPRECATION = r".*quantized tensor creation functions.*deprecated.*"
_q = torch.ops.quantized
_CONV_OPS = {
    1: (_q.conv1d_prepack, _q.conv1d, _q.conv1d_relu),
    2: (_q.conv2d_prepack, _q.conv2d, _q.conv2d_relu),
    3: (_q.conv3d_prepack, _q.conv3d, _q.conv3d_relu),
}


def _tell_once() -> None:
    global _TOLD
    if not _TOLD:
        _TOLD = True
        warnings.filterwarnings("ignore", message=_DEPRECATION)
        log.warning(
            "note: fxquant's fbgemm/qnnpack backends use torch's quantized dtypes, which torch 2.13 deprecates "
            "(pytorch issue 184982); the 'onednn' and 'reference' backends do not use them."
        )


@contextlib.contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """Set ``torch.backends.quantized.engine`` for the block and restore it afterwards."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def _weight_tensor(weight: torch.Tensor, w_qp: QParams) -> torch.Tensor:
    if w_qp.axis is None:
        scale, zp = w_qp.scalar()
        return torch._make_per_tensor_quantized_tensor(weight, scale, zp)
    return torch._make_per_channel_quantized_tensor(
        weight, w_qp.scale.double(), w_qp.zero_point, w_qp.axis
    )


def _within(y: torch.Tensor, qp: QParams) -> torch.Tensor:
    """The kernels saturate to [0, 255]; a narrower range (7-bit activations) needs one more clamp, or a value
    beyond the calibrated range reaches a grouped conv's 16-bit pair sums (and differs from the simulation)."""
    if (qp.qmin, qp.qmax) == UINT8_RANGE:
        return y
    scale, zp = qp.scalar()
    return torch.clamp(y, (qp.qmin - zp) * scale, (qp.qmax - zp) * scale)


def _canonical(a: torch.Tensor) -> torch.Tensor:
    """``a`` with the strides torch's quantized pools expect. They misread a tensor that is channels-last by its
    flags but not by its strides (a batch of one reshaped from a channels-last conv output: 42-66 steps off,
    measured with torch 2.13), so anything but canonical contiguous or channels-last strides is copied."""
    formats = [torch.contiguous_format, *([torch.channels_last] if a.dim() == 4 else [])]
    if any(a.stride() == torch.empty(a.shape, memory_format=f, device="meta").stride() for f in formats):
        return a
    return a.contiguous()


class _QuantizedDtypeBackend(Backend):
    engine = ""
    pool_rounds_stored_integers = True

    @classmethod
    def is_available(cls) -> bool:
        return cls.engine in torch.backends.quantized.supported_engines

    def __init__(self) -> None:
        _tell_once()

    def quantize(self, x: torch.Tensor, qp: QParams) -> torch.Tensor:
        scale, zp = qp.scalar()
        return _within(torch.quantize_per_tensor(x.float(), scale, zp, torch.quint8), qp)

    def dequantize(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return a.dequantize()

    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None) -> PackedWeight:
        with quantized_engine(self.engine):
            payload = _q.linear_prepack(_weight_tensor(weight, w_qp), bias)
        return PackedWeight(self.name, payload)

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        scale, zp = out_qp.scalar()
        op = _q.linear_relu if relu else _q.linear
        return _within(op(a, packed.payload, scale, zp), out_qp)

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        prepack = _CONV_OPS[spec.dim][0]
        with quantized_engine(self.engine):
            payload = prepack(_weight_tensor(weight, w_qp), bias, list(spec.stride), list(spec.padding),
                              list(spec.dilation), spec.groups)
        return PackedWeight(self.name, (spec.dim, payload))

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        dim, payload = packed.payload
        scale, zp = out_qp.scalar()
        return _within(_CONV_OPS[dim][2 if relu else 1](a, payload, scale, zp), out_qp)

    def add(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams, *,
            relu: bool) -> torch.Tensor:
        scale, zp = qout.scalar()
        return _within((_q.add_relu if relu else _q.add)(a, b, scale, zp), qout)

    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return torch.relu(a)

    def mul(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams) -> torch.Tensor:
        scale, zp = qout.scalar()
        return _within(_q.mul(a, b, scale, zp), qout)

    def cat(self, values: list[torch.Tensor], qps: list[QParams], qout: QParams, dim: int) -> torch.Tensor:
        scale, zp = qout.scalar()
        return _within(_q.cat(values, dim, scale, zp), qout)

    def prepack_conv_transpose(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                               spec: ConvSpec) -> PackedWeight:
        prepack = _q.conv_transpose1d_prepack if spec.dim == 1 else _q.conv_transpose2d_prepack
        with quantized_engine(self.engine):
            payload = prepack(_weight_tensor(weight, w_qp), bias, list(spec.stride), list(spec.padding),
                              list(spec.output_padding), list(spec.dilation), spec.groups)
        return PackedWeight(self.name, (spec.dim, payload))

    def conv_transpose(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams) -> torch.Tensor:
        dim, payload = packed.payload
        scale, zp = out_qp.scalar()
        return _within((_q.conv_transpose1d if dim == 1 else _q.conv_transpose2d)(a, payload, scale, zp), out_qp)

    def adaptive_avg_pool(self, a: torch.Tensor, qp: QParams, output_size: Any) -> torch.Tensor:
        fn = {3: F.adaptive_avg_pool1d, 4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}[a.dim()]
        if all(size == 1 for size in a.shape[2:]):
            # torch 2.13's quantized kernel returns garbage when one input position is pooled to several outputs
            # (measured 30-86 steps off); each output is then the input value itself, exact through float.
            return self.quantize(fn(self.dequantize(a, qp), output_size), qp)
        return fn(_canonical(a), output_size)

    def avg_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[dim]
        return fn(_canonical(a), **kwargs)

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        return super().max_pool(_canonical(a), qp, dim, kwargs)


@register_backend("fbgemm")
class FbgemmBackend(_QuantizedDtypeBackend):
    """x86 server kernels. Without VNNI (and always for grouped convs) u8*s8 pairs sum in 16 bits, so
    activations that feed them use 7 bits to avoid silent saturation."""

    engine = "fbgemm"

    def activation_qrange(self, *, feeds_grouped_conv: bool) -> tuple[int, int]:
        if feeds_grouped_conv or not has_vnni():
            return REDUCED_UINT8_RANGE
        return UINT8_RANGE

    def prepack_conv_transpose(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                               spec: ConvSpec) -> PackedWeight:
        """fbgemm's own transposed-conv prepack corrupts the weights in torch 2.13 (measured: error 8.1 on outputs
        of range 2.4); a qnnpack-packed weight runs on the same quint8 tensors and is correct."""
        if "qnnpack" not in torch.backends.quantized.supported_engines:
            return Backend.prepack_conv_transpose(self, weight, w_qp, bias, spec)
        packed = QnnpackBackend.prepack_conv_transpose(_qnnpack(), weight, w_qp, bias, spec)
        return PackedWeight(self.name, packed.payload)

    def conv_transpose(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams) -> torch.Tensor:
        if isinstance(packed.payload[0], ConvSpec):  # the float fallback's payload
            return Backend.conv_transpose(self, a, packed, in_qp, out_qp)
        return super().conv_transpose(a, packed, in_qp, out_qp)


@register_backend("qnnpack")
class QnnpackBackend(_QuantizedDtypeBackend):
    """Mobile-first kernels; its convs return channels-last tensors, made contiguous before element-wise ops."""

    engine = "qnnpack"
    int32_bias = True  # measured: a bias beyond 2**31 steps of s_x * s_w wraps (fbgemm adds a float bias)

    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return torch.relu(a.contiguous())


def _qnnpack() -> QnnpackBackend:
    from fxquant.kernels.registry import get_backend

    backend = get_backend("qnnpack")
    assert isinstance(backend, QnnpackBackend)
    return backend

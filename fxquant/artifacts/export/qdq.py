"""The QDQ form of a converted model: every INT8 op written as ONNX's QuantizeLinear/DequantizeLinear around a float op.

ONNX Runtime (and every other QDQ consumer: TensorRT, OpenVINO, QNN) recognizes ``DequantizeLinear -> Conv/Gemm/
MatMul/Add/... -> QuantizeLinear`` with int8 weights and an int32 bias and runs it as one INT8 kernel (QLinearConv,
QGemm, QLinearMatMul, QLinearAdd). So the export re-lowers a copy of the converted model onto :class:`QdqBackend`,
whose every method builds exactly that pattern from two custom ops, ``fxquant_qdq::quantize_linear`` and
``fxquant_qdq::dequantize_linear``, and ``torch.onnx.export`` translates the two ops into the ONNX ones
(:mod:`fxquant.artifacts.export.onnx`). The ops also run eagerly (the ONNX formulas in torch), so the re-lowered
model computes what the ONNX file declares.

What each INT8 layer becomes, and why:

* activations stay uint8 (the converted model's zero points and scales; a range narrower than the dtype's, the
  7-bit activations fbgemm's depthwise kernels take, is a Clip on the uint8 tensor);
* weights are int8 initializers with one DequantizeLinear per layer (per-channel on the output axis), the bias an
  int32 initializer at scale ``s_x * s_w`` (ONNX's QDQ convention, and the reference backend's own rounding), so
  ORT's fusions take them without a float weight in the file;
* a Linear runs as Gemm on a 2-d view of its input (reshaped while still uint8, so the DequantizeLinear feeds the
  Gemm directly, which ORT's fusion needs); a fused ReLU is a Relu before the output QuantizeLinear, which ORT folds
  into the kernel when the output zero point is the range's minimum, as calibration makes it;
* element-wise ops (add, mul, pools, ReLU, concatenation) are the float op between DequantizeLinear and
  QuantizeLinear (QLinearAdd, QLinearMul, ... in ORT); a table lookup (SiLU, GELU, ... between INT8 layers; the
  INT8 sigmoid, hardsigmoid and tanh) is a Gather on its 256 entries, exact.

A Linear whose float result feeds float code is a Gemm with no QuantizeLinear after it (ORT runs QGemm with a float
output), unrounded like the reference backend's. A Conv's is rounded to its output qparams first (DequantizeLinear
of the INT8 kernel's output): ORT has no INT8 convolution with a float output, so such a result can differ from the
reference backend's by half an output step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fxquant.errors import ArtifactError
from fxquant.kernels.base import Backend, ConvSpec, PackedWeight
from fxquant.kernels.plain_int8 import weight_scale
from fxquant.kernels.reference import fixed_range_table
from fxquant.qparams import QParams

NAMESPACE = "fxquant_qdq"
_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVS_TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@torch.library.custom_op(f"{NAMESPACE}::quantize_linear", mutates_args=())
def quantize_linear(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """ONNX QuantizeLinear (per tensor): ``saturate(round_half_even(x / scale) + zero_point)`` in the zero point's
    integer dtype."""
    info = torch.iinfo(zero_point.dtype)
    steps = torch.round(x.float() / scale) + zero_point.to(torch.float32)
    return steps.clamp(info.min, info.max).to(zero_point.dtype)


@quantize_linear.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=zero_point.dtype)


@torch.library.custom_op(f"{NAMESPACE}::dequantize_linear", mutates_args=())
def dequantize_linear(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX DequantizeLinear: ``(q - zero_point) * scale``, per tensor or (1-d scale) along ``axis``."""
    shape = [1] * q.dim()
    if scale.dim() == 1:
        shape[axis] = -1
    return (q.to(torch.float32) - zero_point.to(torch.float32).reshape(shape)) * scale.reshape(shape)


@dequantize_linear.register_fake
def _(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    return torch.empty_like(q, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::conv_integer", mutates_args=())
def conv_integer(x: torch.Tensor, x_zero_point: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
                 dilation: list[int], groups: int) -> torch.Tensor:
    """ONNX ConvInteger: the exact int32 accumulator of ``(x - x_zero_point)`` and int8 ``w`` (float64 on the
    integers, exact as in the reference backend)."""
    centered = x.to(torch.float64) - x_zero_point.to(torch.float64)
    out = _CONVS[w.dim() - 2](centered, w.to(torch.float64), None, stride, padding, dilation, groups)
    return out.to(torch.int32)


@conv_integer.register_fake
def _(x: torch.Tensor, x_zero_point: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
      dilation: list[int], groups: int) -> torch.Tensor:
    real = _CONVS[w.dim() - 2](torch.empty_like(x, dtype=torch.float32), torch.empty_like(w, dtype=torch.float32),
                               None, stride, padding, dilation, groups)
    return torch.empty_like(real, dtype=torch.int32)


@dataclass(frozen=True)
class QdqWeight:
    """A layer's int8 weight with its DequantizeLinear constants and the int32 bias (or None)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bias: torch.Tensor | None
    bias_scale: torch.Tensor
    axis: int
    spec: ConvSpec | None = None

    def float_weight(self) -> torch.Tensor:
        return dequantize_linear(self.weight, self.scale, self.zero_point, self.axis)

    def float_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return dequantize_linear(self.bias, self.bias_scale, torch.zeros(self.bias_scale.shape, dtype=torch.int32), 0)


def _constants(qp: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    if qp.per_channel:
        raise ArtifactError("an activation with per-channel qparams has no QuantizeLinear form here; convert with "
                            "per-tensor activation observers to export")
    scale, zero_point = qp.scalar()
    return torch.tensor(scale, dtype=torch.float32), torch.tensor(zero_point, dtype=qp.dtype)


def _pack(backend: Backend, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
          in_qp: QParams | None, spec: ConvSpec | None, *, transpose: bool = False) -> PackedWeight:
    """``transpose``: store the (out, in) weight as (in, out), Gemm's B, with its scales on axis 1."""
    scale = weight_scale(w_qp, weight)
    axis = 1 if transpose else 0
    if transpose:
        weight = weight.t().contiguous()
    if in_qp is None and bias is not None:
        raise ArtifactError("a layer with a bias but no input qparams has no int32 bias; convert it again")
    bias_scale = (float(in_qp.scale) if in_qp is not None else 1.0) * scale.to(torch.float64)
    bias_int = None if bias is None else torch.round(bias.detach().to(torch.float64) / bias_scale).to(torch.int32)
    per_channel = scale.dim() == 1
    return PackedWeight(backend.name, QdqWeight(
        weight.to(torch.int8), scale, torch.zeros(scale.shape, dtype=torch.int8),
        bias_int, (bias_scale if per_channel else bias_scale.reshape(1)).to(torch.float32),
        axis if per_channel else 0, spec))


class QdqBackend(Backend):
    """The converted model's arithmetic as QuantizeLinear/DequantizeLinear around float ops (module doc)."""

    name = "qdq"

    def quantize(self, x: torch.Tensor, qp: QParams) -> torch.Tensor:
        q = quantize_linear(x, *_constants(qp))
        info = torch.iinfo(qp.dtype)
        return q if (qp.qmin, qp.qmax) == (info.min, info.max) else q.clamp(qp.qmin, qp.qmax)

    def dequantize(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        if a.is_floating_point():  # a layer with a float output already is
            return a
        scale, zero_point = _constants(qp)
        return dequantize_linear(a, scale, zero_point, 0)

    def _requantize(self, out: torch.Tensor, out_qp: QParams, *, relu: bool) -> torch.Tensor:
        return self.quantize(torch.relu(out) if relu else out, out_qp)

    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, *,
                       in_qp: QParams | None = None) -> PackedWeight:
        return _pack(self, weight, w_qp, bias, in_qp, None, transpose=True)

    def _gemm(self, a: torch.Tensor, w: QdqWeight, in_qp: QParams) -> torch.Tensor:
        """The float Gemm between the DequantizeLinears, on ``a``'s 2-d view (reshaped while still uint8)."""
        rows = self.dequantize(a.reshape(-1, a.shape[-1]), in_qp)
        bias = w.float_bias()
        return torch.mm(rows, w.float_weight()) if bias is None else torch.addmm(bias, rows, w.float_weight())

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        w: QdqWeight = packed.payload
        out = self._requantize(self._gemm(a, w, in_qp), out_qp, relu=relu)
        return out.reshape(*a.shape[:-1], w.weight.shape[1])

    def linear_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                        relu: bool) -> torch.Tensor:
        """Unrounded, like the reference backend: a Gemm with no QuantizeLinear after it (ORT: QGemm with a float
        output)."""
        w: QdqWeight = packed.payload
        out = self._gemm(a, w, in_qp)
        return (torch.relu(out) if relu else out).reshape(*a.shape[:-1], w.weight.shape[1])

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        return _pack(self, weight, w_qp, bias, in_qp, spec)

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        w: QdqWeight = packed.payload
        assert w.spec is not None, "conv() got weights packed by prepack_linear()"
        spec = w.spec
        out = _CONVS[spec.dim](self.dequantize(a.contiguous(), in_qp), w.float_weight(), w.float_bias(),
                               spec.stride, spec.padding, spec.dilation, spec.groups)
        return self._requantize(out, out_qp, relu=relu)

    def conv_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                      relu: bool) -> torch.Tensor:
        """Unrounded, like the reference backend: ConvInteger's int32 accumulator plus the int32 bias, times
        ``s_x * s_w`` (ORT has no QDQ convolution with a float output; ConvInteger is its INT8 kernel)."""
        w: QdqWeight = packed.payload
        assert w.spec is not None, "conv_to_float() got weights packed by prepack_linear()"
        spec = w.spec
        _, zero_point = _constants(in_qp)
        acc = conv_integer(a.contiguous(), zero_point, w.weight, list(spec.stride), list(spec.padding),
                           list(spec.dilation), spec.groups)
        channels = (-1, *([1] * spec.dim))
        if w.bias is not None:
            acc = acc + w.bias.reshape(channels)
        out = acc.to(torch.float32) * w.bias_scale.reshape(channels)
        return torch.relu(out) if relu else out

    def prepack_conv_transpose(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                               spec: ConvSpec, *, in_qp: QParams | None = None) -> PackedWeight:
        return _pack(self, weight, w_qp, bias, in_qp, spec)  # per tensor (no kernel takes per-channel here)

    def conv_transpose(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams) -> torch.Tensor:
        w: QdqWeight = packed.payload
        assert w.spec is not None, "conv_transpose() got weights packed by prepack_linear()"
        spec = w.spec
        out = _CONVS_TRANSPOSED[spec.dim](self.dequantize(a, in_qp), w.float_weight(), w.float_bias(), spec.stride,
                                          spec.padding, spec.output_padding, spec.groups, spec.dilation)
        return self.quantize(out, out_qp)

    def add(self, a: torch.Tensor, b: torch.Tensor, qa: QParams, qb: QParams, qout: QParams, *,
            relu: bool) -> torch.Tensor:
        return self._requantize(self.dequantize(a, qa) + self.dequantize(b, qb), qout, relu=relu)

    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return self.quantize(torch.relu(self.dequantize(a, qp)), qp)

    def adaptive_avg_pool(self, a: torch.Tensor, qp: QParams, output_size: Any) -> torch.Tensor:
        pools = {3: F.adaptive_avg_pool1d, 4: F.adaptive_avg_pool2d, 5: F.adaptive_avg_pool3d}
        return self.quantize(pools[a.dim()](self.dequantize(a, qp), output_size), qp)

    def avg_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        pools = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
        return self.quantize(pools[dim](self.dequantize(a, qp), **kwargs), qp)

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        pools = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
        return self.quantize(pools[dim](self.dequantize(a, qp), **kwargs), qp)

    def cat(self, values: list[torch.Tensor], qps: list[QParams], qout: QParams, dim: int) -> torch.Tensor:
        return self.quantize(torch.cat([self.dequantize(v, qp) for v, qp in zip(values, qps, strict=True)], dim), qout)

    # Reinterpreting bytes (``view(dtype)``) has no ONNX op: skipped where the dtype is already the one wanted.
    def from_bytes(self, stored: torch.Tensor, qp: QParams) -> torch.Tensor:
        return stored if stored.dtype == qp.dtype else stored.view(qp.dtype)

    def to_bytes(self, a: torch.Tensor) -> torch.Tensor:
        return a if a.dtype == torch.uint8 else a.view(torch.uint8)

    def lookup(self, a: torch.Tensor, table: torch.Tensor, qout: QParams) -> torch.Tensor:
        return self.from_bytes(table[self.to_bytes(a).long()], qout)  # ONNX Gather on the 256 bytes: exact

    def fixed_range(self, a: torch.Tensor, function: str, qa: QParams, qout: QParams) -> torch.Tensor:
        """The reference backend's table (the function in float64, rounded once), gathered: exact."""
        return fixed_range_table(function, qa, qout)[a.long()]

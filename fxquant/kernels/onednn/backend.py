"""The ``onednn`` backend: oneDNN int8 kernels (``torch.ops.onednn``, the ops torch.compile's x86 inductor lowers to)
on plain tensors.

Linear/Conv layers run on oneDNN primitives fxquant builds once per input shape
(:mod:`fxquant.kernels.onednn.direct`) where the oneDNN library is installed, and on these ops otherwise (and for the
shapes that need workarounds, :mod:`fxquant.kernels.onednn.workarounds`); both give the same integers. Activations
are plain ``torch.uint8`` tensors and weights plain ``torch.int8``: no quantized dtype, no global engine. This module
maps the Backend interface onto the packed weights (:mod:`~fxquant.kernels.onednn.weights`) and the calls bound to
them (:mod:`~fxquant.kernels.onednn.calls`). Conventions, checked against the op schemas of torch 2.13 and
numerically against the reference backend:

* ``qlinear_pointwise`` / ``qconv_pointwise`` take the *real* output scale (oneDNN divides by it). A schema that
  names the argument ``inv_output_scale`` takes ``1 / scale`` instead, so ``is_available`` rejects schemas without
  ``output_scale``/``output_dtype``.
* The bias stays float and is added after the accumulator is scaled; fbgemm and the reference backend round it to
  int32 first, which can move an output by at most one step.
* Weight zero points must be 0; scales are 0-d (per-tensor) or one per output channel.
* Conv returns channels-last tensors, so inputs are made channels-last up front (a no-op between two convs).

With VNNI/AMX, u8*s8 products accumulate in int32 and activations use the full 8-bit range (exact, including the
depthwise case where fbgemm saturates). Without VNNI, pairs of u8*s8 products are summed in 16 bits
(``vpmaddubsw``); oneDNN's weight pre-scaling (``scale_adjust``) only covers signed sources, so u8 activations drop
to 7 bits there, as for fbgemm; Linears on up to 32 rows run on fxquant's AVX2 row loop there, which computes
the primitive's bytes faster (:mod:`fxquant.kernels.onednn.rows`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fxquant.kernels.base import ConvAddQParams, ConvSpec, PackedWeight
from fxquant.kernels.onednn.calls import bind_conv, bind_conv_add, bind_linear
from fxquant.kernels.onednn.max_pool import channels_last_max_pool
from fxquant.kernels.onednn.post_ops import FLOAT_OUTPUT, relu_post_op, uint8_output
from fxquant.kernels.onednn.weights import Call, OnednnWeight, bound, pack_conv, pack_linear
from fxquant.kernels.plain_int8 import PlainInt8Backend
from fxquant.kernels.registry import register_backend
from fxquant.native.isa import has_vnni
from fxquant.qparams import REDUCED_UINT8_RANGE, UINT8_RANGE, QParams

_OPS = ("qlinear_prepack", "qlinear_pointwise", "qconv_prepack", "qconv_pointwise")


def _schema_is_verified(op: Any) -> bool:
    names = {argument.name for argument in op.default._schema.arguments}
    return {"output_scale", "output_dtype"} <= names


@register_backend("onednn")
class OnednnBackend(PlainInt8Backend):
    """x86 oneDNN kernels (VNNI, AMX) on plain int8 tensors; element-wise ops run in float32 for speed."""

    elementwise_dtype = torch.float32
    channels_last = True
    fuses_conv_add = True
    fuses_float_output = True
    fuses_float_conv_output = True
    fused_linear_unary = frozenset({"silu", "hardswish", "gelu", "gelu_tanh"})
    fused_conv_unary = frozenset({"silu", "hardswish"})
    fallback = "reference"  # same plain-uint8 activations: a layer oneDNN cannot run needs no conversion

    @classmethod
    def is_available(cls) -> bool:
        try:
            ops = [getattr(torch.ops.onednn, name) for name in _OPS]
        except (AttributeError, RuntimeError):
            return False
        schemas_ok = _schema_is_verified(ops[1]) and _schema_is_verified(ops[3])
        return schemas_ok and torch.backends.mkldnn.is_available()

    def activation_qrange(self, *, feeds_grouped_conv: bool) -> tuple[int, int]:
        return UINT8_RANGE if has_vnni() else REDUCED_UINT8_RANGE

    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, *,
                       in_qp: QParams | None = None) -> PackedWeight:
        return PackedWeight(self.name, pack_linear(weight, w_qp, bias, in_qp))

    def holds_weight(self, packed: PackedWeight) -> bool:
        return isinstance(packed.payload, OnednnWeight) and packed.payload.holds_weight()  # (not transposed convs')

    def unpacked_weight(self, packed: PackedWeight) -> torch.Tensor:
        return packed.payload.unpacked()

    def unpacked_rows(self, packed: PackedWeight, outputs: torch.Tensor) -> torch.Tensor:
        return packed.payload.rows(outputs)

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        w: OnednnWeight = packed.payload
        return bound(w, (a.shape, torch.get_num_threads(), in_qp, out_qp, relu),
                     lambda: bind_linear(w, tuple(a.shape), in_qp, uint8_output(out_qp), relu_post_op(relu),
                                         out_qp))(a)

    def linear_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                        relu: bool) -> torch.Tensor:
        w: OnednnWeight = packed.payload
        return bound(w, (a.shape, torch.get_num_threads(), in_qp, FLOAT_OUTPUT, relu),
                     lambda: bind_linear(w, tuple(a.shape), in_qp, FLOAT_OUTPUT, relu_post_op(relu), None))(a)

    def linear_unary(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, unary: str,
                     unary_qp: QParams) -> torch.Tensor:
        """The function as the op's post-op: one call, one rounding, no float tensor in between."""
        w: OnednnWeight = packed.payload
        return bound(w, (a.shape, torch.get_num_threads(), in_qp, unary_qp, unary),
                     lambda: bind_linear(w, tuple(a.shape), in_qp, uint8_output(unary_qp), unary, unary_qp))(a)

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        return PackedWeight(self.name, pack_conv(weight, w_qp, bias, spec, in_qp))

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        w: OnednnWeight = packed.payload
        return bound(w, (a.shape, torch.get_num_threads(), in_qp, out_qp, relu),
                     lambda: bind_conv(w, tuple(a.shape), in_qp, uint8_output(out_qp), relu_post_op(relu), out_qp))(a)

    def conv_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                      relu: bool) -> torch.Tensor:
        """``qconv_pointwise`` with ``output_dtype`` float32, scale 1, zero point 0: the unrounded float result."""
        w: OnednnWeight = packed.payload
        return bound(w, (a.shape, torch.get_num_threads(), in_qp, FLOAT_OUTPUT, relu),
                     lambda: bind_conv(w, tuple(a.shape), in_qp, FLOAT_OUTPUT, relu_post_op(relu), None))(a)

    def conv_unary(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, unary: str,
                   unary_qp: QParams) -> torch.Tensor:
        """As ``linear_unary`` for conv2d (and conv1d, packed as a conv2d); conv3d refuses these post-ops
        ("Unsupported post op swish for quantized pointwise conv3d"), so it runs the unfused sequence."""
        w: OnednnWeight = packed.payload
        assert w.spec is not None, "conv_unary() got weights packed by prepack_linear()"
        if w.spec.dim != 2:
            return super().conv_unary(a, packed, in_qp, out_qp, unary, unary_qp)
        return bound(w, (a.shape, torch.get_num_threads(), in_qp, unary_qp, unary),
                     lambda: bind_conv(w, tuple(a.shape), in_qp, uint8_output(unary_qp), unary, unary_qp))(a)

    def conv_add(self, a: torch.Tensor, packed: PackedWeight, accum: torch.Tensor, qps: ConvAddQParams, *,
                 relu: bool) -> torch.Tensor:
        """``qconv2d_pointwise.binary`` with the ``sum`` post-op: oneDNN adds ``accum`` to the float conv result
        and rounds once, writing into ``accum`` (channels-last uint8 of the output's shape). Shapes the fused op
        does not take (conv1d, the one-column workaround) run as conv then add."""
        w: OnednnWeight = packed.payload
        fused = bound(w, (a.shape, torch.get_num_threads(), accum.shape, accum.dtype, qps, relu),
                      lambda: self._bind_conv_add(w, tuple(a.shape), accum, qps, relu))
        return fused(a, accum)

    def _bind_conv_add(self, w: OnednnWeight, shape: tuple[int, ...], accum: torch.Tensor, qps: ConvAddQParams,
                       relu: bool) -> Call:
        """``conv_add``'s call for inputs of ``shape`` and an ``accum`` like this one: the fused op, or conv then
        add where the fused op does not apply."""
        fused = bind_conv_add(w, shape, accum, qps, relu)
        if fused is not None:
            return fused
        unfused = functools.partial(super().conv_add, packed=PackedWeight(self.name, w), qps=qps, relu=relu)
        return lambda a, accum: unfused(a, accum=accum)

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        """``quantized::max_pool2d`` on channels-last plain uint8 (:mod:`fxquant.kernels.onednn.max_pool`), else
        ``PlainInt8Backend.max_pool``."""
        out = channels_last_max_pool(a, dim, kwargs)
        return super().max_pool(a, qp, dim, kwargs) if out is None else out

"""The ``fbgemm`` and ``qnnpack`` backends: ``torch.ops.quantized`` kernels on quantized-dtype tensors.

The tensors themselves and the engine switch come from :mod:`fxquant.kernels.torch_engines.engine`; convs and
Linears take fxquant's C loops where those compute the engine's bytes faster
(:mod:`fxquant.kernels.torch_engines.amx_conv`); transposed convs go around a broken fbgemm kernel
(:mod:`fxquant.kernels.torch_engines.transposed`); fbgemm's float-output Linears run on oneDNN
(:mod:`fxquant.kernels.torch_engines.onednn_bridge`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from fxquant import native
from fxquant.kernels.base import Backend, ConvSpec, PackedWeight, same_grid
from fxquant.kernels.registry import register_backend
from fxquant.kernels.torch_engines.amx_conv import NativeConv, native_conv, run_conv, run_linear
from fxquant.kernels.torch_engines.engine import (
    bytes_of,
    dequantized,
    empty_quantized,
    has_engine,
    is_quint8,
    note_deprecation,
    prepack_weight,
    quantize_quint8,
    quint8_from_bytes,
    stored_integers,
)
from fxquant.kernels.torch_engines.onednn_bridge import onednn_backend, onednn_weight
from fxquant.kernels.torch_engines.transposed import (
    Transposed,
    as_patches,
    depth_to_space,
    direct_conv_path,
    native_patches,
    patch_linear,
    run_patches,
    with_zero_channel,
)
from fxquant.native.isa import has_vnni
from fxquant.qparams import REDUCED_UINT8_RANGE, UINT8_RANGE, QParams

_q = torch.ops.quantized
_ROWS = ConvSpec(1, (1,), (0,), (1,), 1, False, (0,))  # a Linear as a 1x1 conv over its rows
_CONV_OPS = {
    1: (_q.conv1d_prepack, _q.conv1d, _q.conv1d_relu),
    2: (_q.conv2d_prepack, _q.conv2d, _q.conv2d_relu),
    3: (_q.conv3d_prepack, _q.conv3d, _q.conv3d_relu),
}


def _within(y: torch.Tensor, qp: QParams) -> torch.Tensor:
    """The kernels saturate to [0, 255]; a narrower range (7-bit activations) needs one more clamp, or a value
    beyond the calibrated range reaches a grouped conv's 16-bit pair sums (and differs from the simulation)."""
    if (qp.qmin, qp.qmax) == UINT8_RANGE:
        return y
    scale, zp = qp.scalar()
    return torch.clamp(y, (qp.qmin - zp) * scale, (qp.qmax - zp) * scale)


def _loop_for(loop: NativeConv | None, qp: QParams) -> NativeConv | None:
    """The C loop where it can stand for the engine's op and :func:`_within`: it saturates its outputs to
    ``[0, qmax]`` itself, so an output range that starts above 0 keeps the op and the clamp."""
    return loop if qp.qmin == 0 else None


def _canonical(a: torch.Tensor) -> torch.Tensor:
    """``a`` with the strides torch's quantized pools expect. They misread a tensor that is channels-last by its
    flags but not by its strides (a batch of one reshaped from a channels-last conv output: 42-66 steps off,
    measured with torch 2.13), so anything but canonical contiguous or channels-last strides (for 3-d tensors: the
    (N, L, C) layout conv1d returns) is copied."""
    return a if _is_canonical(a.shape, a.stride()) else a.contiguous()


@functools.lru_cache(maxsize=1024)
def _is_canonical(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Worked out once per (shape, strides): a pool runs on every call, and the check costs more than a lookup."""
    if stride == _dense_strides(shape, range(len(shape))):
        return True
    return len(shape) in (3, 4) and stride == _dense_strides(shape, (0, *range(2, len(shape)), 1))  # channels last


def _dense_strides(shape: torch.Size, order: Any) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dims are laid out in ``order`` (outermost first), as
    ``torch.empty`` gives them; computed, not allocated."""
    strides, step = [0] * len(shape), 1
    for dim in reversed(tuple(order)):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


# The kernels' own output qparams for these functions on quint8 (scale, zero point): fixed by the function's range.
_FIXED_KERNELS: dict[str, tuple[Any, float, int]] = {
    "sigmoid": (torch.sigmoid, 1 / 256, 0), "hardsigmoid": (F.hardsigmoid, 1 / 256, 0),
    "tanh": (torch.tanh, 2 / 256, 128),
}


class _QuantizedDtypeBackend(Backend):
    engine = ""
    pool_rounds_stored_integers = True

    @classmethod
    def is_available(cls) -> bool:
        return has_engine(cls.engine)

    def __init__(self) -> None:
        note_deprecation()

    def quantize(self, x: torch.Tensor, qp: QParams) -> torch.Tensor:
        scale, zp = qp.scalar()
        x = x if x.dtype == torch.float32 else x.float()  # skips a dispatched no-op ``to`` per call
        return _within(quantize_quint8(x, scale, zp), qp)

    def dequantize(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return dequantized(a)

    def from_bytes(self, stored: torch.Tensor, qp: QParams) -> torch.Tensor:
        scale, zp = qp.scalar()
        return quint8_from_bytes(stored, scale, zp)

    def to_bytes(self, a: torch.Tensor) -> torch.Tensor:
        return bytes_of(a)

    def lookup(self, a: torch.Tensor, table: torch.Tensor, qout: QParams) -> torch.Tensor:
        if not is_quint8(a):  # the table reads raw bytes: another dtype would be misread
            raise TypeError(f"an int8 lookup on {self.name} takes quint8 activations, got {a.dtype}")
        scale, zp = qout.scalar()
        memory_format = native.dense_format(a)
        if not native.available() or torch.jit.is_tracing() or memory_format is None:  # traced: torch ops, same table
            return quint8_from_bytes(table[bytes_of(a).long()], scale, zp)
        out = empty_quantized(a.shape, scale, zp, memory_format=memory_format)
        return native.lookup_into(out, a, table)

    def prepack_linear(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, *,
                       in_qp: QParams | None = None) -> PackedWeight:
        payload = prepack_weight(self.engine, _q.linear_prepack, weight, w_qp, bias)
        # the engine's Linear is its 1x1 conv over the rows: the same sums and requantization
        loop = native_conv(weight.unsqueeze(-1), w_qp, bias, _ROWS, engine=self.engine, linear=True)
        return PackedWeight(self.name, (payload, loop))

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        payload, loop = packed.payload
        scale, zp = out_qp.scalar()
        out = run_linear(a, _loop_for(loop, out_qp), scale, zp, relu, out_qp.qmax)  # saturates to the range itself
        if out is None:
            out = _within((_q.linear_relu if relu else _q.linear)(a, payload, scale, zp), out_qp)
        return out

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        payload = prepack_weight(self.engine, _CONV_OPS[spec.dim][0], weight, w_qp, bias, list(spec.stride),
                                 list(spec.padding), list(spec.dilation), spec.groups)
        loop = native_conv(weight, w_qp, bias, spec, engine=self.engine)  # the engine's own bytes, on AMX tiles
        return PackedWeight(self.name, (spec.dim, payload, loop))

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        dim, payload, loop = packed.payload
        scale, zp = out_qp.scalar()
        out = run_conv(a, _loop_for(loop, out_qp), scale, zp, relu, out_qp.qmax)
        if out is None:
            out = _within(_CONV_OPS[dim][2 if relu else 1](a, payload, scale, zp), out_qp)
        return out

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
        if all(same_grid(qp, qout) for qp in qps):  # inputs already on the output's grid: a copy
            out = native.concat(values, dim, lambda shape: empty_quantized(shape, scale, zp, dtype=values[0].dtype))
            return torch.cat(values, dim) if out is None else out
        return _within(_q.cat(values, dim, scale, zp), qout)

    def prepack_conv_transpose(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                               spec: ConvSpec, *, in_qp: QParams | None = None) -> PackedWeight:
        if as_patches(weight, spec) and w_qp.axis is None:
            rows, tiled = patch_linear(weight, bias, spec)
            packed = prepack_weight(self.engine, _q.linear_prepack, rows, w_qp, tiled)
            scale, zp = w_qp.scalar()
            loop = None  # the C loop computes what fbgemm's Linear computes on a VNNI CPU (exact 32-bit sums)
            if self.engine == "fbgemm" and native.loops is not None and has_vnni() and zp == 0:
                loop = native_patches(rows, tiled, scale, weight.shape[1])
            return PackedWeight(self.name, Transposed(spec.dim, packed, patches=spec.stride, native=loop))
        keep = 0
        if self.engine == "fbgemm" and direct_conv_path(weight, spec):  # its direct kernel is wrong
            weight, bias, keep = with_zero_channel(weight, bias)
        prepack = _q.conv_transpose1d_prepack if spec.dim == 1 else _q.conv_transpose2d_prepack
        payload = prepack_weight(self.engine, prepack, weight, w_qp, bias, list(spec.stride), list(spec.padding),
                                 list(spec.output_padding), list(spec.dilation), spec.groups)
        return PackedWeight(self.name, Transposed(spec.dim, payload, keep=keep))

    def conv_transpose(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams) -> torch.Tensor:
        t: Transposed = packed.payload
        scale, zp = out_qp.scalar()
        if t.patches:
            out = run_patches(a, t, scale, zp)
            if out is None:
                out = depth_to_space(_q.linear(a.movedim(1, -1), t.packed, scale, zp), a, t)
            return _within(out, out_qp)
        out = (_q.conv_transpose1d if t.dim == 1 else _q.conv_transpose2d)(a, t.packed, scale, zp)
        return _within(out[:, :t.keep] if t.keep else out, out_qp)

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
        if dim == 1:  # torch's quantized 1-d pool reads the (N, L, C)-strided conv1d outputs as they are: no copy
            return F.max_pool1d(_canonical(a), **kwargs)
        return super().max_pool(_canonical(a), qp, dim, kwargs)

    def fixed_range(self, a: torch.Tensor, function: str, qa: QParams, qout: QParams) -> torch.Tensor:
        fn, scale, zp = _FIXED_KERNELS[function]
        if qout.scalar() != (scale, zp):  # a narrower range (7-bit activations) than the kernel's own output
            return super().fixed_range(a, function, qa, qout)
        return fn(a)


@register_backend("fbgemm")
class FbgemmBackend(_QuantizedDtypeBackend):
    """x86 server kernels. Without VNNI (and always for grouped convs) u8*s8 pairs sum in 16 bits, so
    activations that feed them use 7 bits to avoid silent saturation.

    Float outputs (``linear_to_float``): fbgemm's own float-output Linear
    (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``) saturates 16-bit pair sums on 8-bit inputs
    (exact with 7-bit inputs; docs/backends.md, "Numerics of the fused ops"), so ``linear_to_float`` runs oneDNN's
    ``qlinear_pointwise`` with a float output on the same integers, where torch has it
    (:mod:`~fxquant.kernels.torch_engines.onednn_bridge`): exact within float rounding, and faster than requantize
    plus dequantize. It is not the default (``fuses_float_output`` stays False): ``torch.jit.trace`` cannot take
    that op, and a traced (exported) model must compute what the eager one does. A model converted for ``onednn``
    and re-lowered here uses it; convs keep requantize plus dequantize.
    """

    engine = "fbgemm"

    def linear_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                        relu: bool) -> torch.Tensor:
        onednn = onednn_backend()
        if onednn is None or torch.jit.is_tracing():  # TorchScript export cannot take the oneDNN op's arguments:
            return super().linear_to_float(a, packed, in_qp, out_qp, relu=relu)  # exported, it rounds as before
        return onednn.linear_to_float(stored_integers(a), onednn_weight(packed, onednn), in_qp, out_qp, relu=relu)

    def activation_qrange(self, *, feeds_grouped_conv: bool) -> tuple[int, int]:
        if feeds_grouped_conv or not has_vnni():
            return REDUCED_UINT8_RANGE
        return UINT8_RANGE


@register_backend("qnnpack")
class QnnpackBackend(_QuantizedDtypeBackend):
    """Mobile-first kernels; its convs return channels-last tensors, made contiguous before element-wise ops."""

    engine = "qnnpack"
    int32_bias = True  # measured: a bias beyond 2**31 steps of s_x * s_w wraps (fbgemm adds a float bias)

    def relu(self, a: torch.Tensor, qp: QParams) -> torch.Tensor:
        return torch.relu(a.contiguous())

"""oneDNN int8 kernels (``torch.ops.onednn``, the ops torch.compile's x86 inductor lowers to) on plain tensors.

Linear/Conv layers run on oneDNN primitives fxquant builds once per input shape
(:mod:`fxquant.kernels.onednn.direct`) where the oneDNN library is installed, and on these ops otherwise (and for the
shapes below that need workarounds); both give the same integers. Activations are plain ``torch.uint8`` tensors and
weights plain ``torch.int8``: no quantized dtype, no global engine.
Conventions, checked against the op schemas of torch 2.13 and numerically against the reference backend:

* ``qlinear_pointwise`` / ``qconv_pointwise`` take the *real* output scale (oneDNN divides by it). Older builds named
  the argument ``inv_output_scale`` and took ``1 / scale``, so ``is_available`` rejects schemas without
  ``output_scale``/``output_dtype``.
* ``output_dtype=torch.uint8`` returns requantized uint8; a ``"relu"`` post-op clamps at the output zero point.
* The bias stays float and is added after the accumulator is scaled; fbgemm and the reference backend round it to
  int32 first, which can move an output by at most one step.
* Weight zero points must be 0; scales are 0-d (per-tensor) or one per output channel.
* Conv returns channels-last tensors, so inputs are made channels-last up front (a no-op between two convs).

What does not work, measured with torch 2.13 (see ``tests/kernels/test_onednn_backend.py``):

* conv3d on an input of depth 1 that is padded in depth comes out wrong (every output off by up to 255 steps, at
  any batch size; a 2x2x2 or 3x3x3 kernel with padding 1): such inputs are padded explicitly, as below. conv3d has
  no ReLU post-op: its ReLU is a clamp at the output zero point after the op. conv1d runs as a conv2d over a height
  of one, packed that way: the op's own 1-d path is slower and takes no SiLU/hardswish post-op.
* When some output reads padding only (padding past the dilated kernel, or an input smaller than the dilation gaps),
  depthwise convs with a channel multiplier come out wrong and grouped convs on tiny inputs can crash the process.
  Those inputs are padded explicitly with the zero point and run unpadded: the same convolution, one copy slower;
  real networks rarely pad that much.
* A conv strided along the width whose output is one column wide (and at least five rows high) comes out wrong.
  The input gets ``stride`` more zero-point columns on the right, which adds a second output column that is
  dropped; the first column sees the same inputs, so it is the same convolution.

With VNNI/AMX, u8*s8 products accumulate in int32 and activations use the full 8-bit range (measured exact here,
including the depthwise case where fbgemm saturates). Without VNNI, pairs of u8*s8 products are summed in 16 bits
(``vpmaddubsw``); oneDNN's weight pre-scaling (``scale_adjust``) only covers signed sources, so u8 activations drop
to 7 bits there, as for fbgemm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from fxquant.kernels.base import ConvAddQParams, ConvSpec, PackedWeight
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.plain_int8 import PlainInt8Backend, weight_scale
from fxquant.kernels.registry import register_backend
from fxquant.native.isa import has_vnni
from fxquant.qparams import REDUCED_UINT8_RANGE, UINT8_RANGE, QParams

_OPS = ("qlinear_prepack", "qlinear_pointwise", "qconv_prepack", "qconv_pointwise")
# fxquant's unary names -> the ops' (post-op, algorithm); both ops round once after it (checked against the
# reference: within one step). qconv has no GELU post-op, and its 3-d form (and its own 1-d one) none of these.
_POST_OPS = {"silu": ("swish", ""), "hardswish": ("hardswish", ""), "gelu": ("gelu", "none"),
             "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "none": ("none", "")}


_SHAPES_PER_WEIGHT = 4  # (input shape, threads) a conv weight is repacked for (e.g. batch 1 and a serving batch)
_CALLS_PER_WEIGHT = 16  # bound calls kept per weight (input shape x threads x output kind); more are built per call
_Call = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class OnednnWeight:
    """A oneDNN-packed weight plus the arguments every call repeats.

    A conv weight is packed once for any input (``packed``) and again for each of the first few input shapes it
    meets (``for_input``): oneDNN picks the blocked weight layout by the input shape and the thread count, and the
    generic one costs up to 22% per call on deep layers (ResNet-18's 512-channel 3x3 conv at batch 32: 6.9 ms against
    5.4 ms), while a layout packed for another shape can cost 3x (batch 1 on a batch-32 layout) and one packed under
    another thread count makes oneDNN reorder the weight on every call (MobileNetV2 at batch 1, first called with two
    threads, then run with one: 43 ms against 9 ms).
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    bias: torch.Tensor | None
    spec: ConvSpec | None = None
    kernel: tuple[int, ...] = ()
    out_channels: int = 0
    repack: Callable[[list[int]], torch.Tensor] | None = None
    by_shape: dict[tuple[tuple[int, ...], int], torch.Tensor] = field(default_factory=dict, compare=False)
    height_one: bool = False  # a conv1d packed as a conv2d over a height of one (see ``prepack_conv``)
    # (input scale and zero point, bias with that zero point folded in): calls with those input qparams pass zero
    # point 0 and that bias (see ``prepack_conv``)
    folded: tuple[tuple[float, int], torch.Tensor] | None = None
    calls: dict[tuple[Any, ...], _Call] = field(default_factory=dict, compare=False)  # see ``_bound``
    plain: torch.Tensor | None = None  # the int8 weight, contiguous, for primitives built directly (onednn_direct)
    shared: list[Any] = field(default_factory=list, compare=False)  # those owning their weights (one per layout)

    def __deepcopy__(self, memo: dict[int, Any]) -> OnednnWeight:
        # The packed tensors are opaque (no storage to copy) and never modified after packing, so copies share them.
        # The bound calls are keyed by the layer's qparams objects, which the copy gets afresh: it binds its own
        # (with the same reordered weights where the layouts match).
        return replace(self, calls={}, shared=list(self.shared))

    def for_input(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The weight packed for inputs of ``shape`` at the current thread count (packed on first use), or the
        generic one past the limit."""
        key = (shape, torch.get_num_threads())
        packed = self.by_shape.get(key)
        if packed is None:
            if self.repack is None or len(self.by_shape) >= _SHAPES_PER_WEIGHT:
                return self.packed
            packed = self.by_shape[key] = self.repack(list(shape))
        return packed


def _schema_is_verified(op: Any) -> bool:
    names = {argument.name for argument in op.default._schema.arguments}
    return {"output_scale", "output_dtype"} <= names


def _onednn_weight(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, packed: torch.Tensor,
                   spec: ConvSpec | None = None, repack: Callable[[list[int]], torch.Tensor] | None = None,
                   height_one: bool = False, folded: tuple[float, int] | None = None) -> OnednnWeight:
    """``folded``: the input (scale, zero point) to fold into a bias: ``layer(q - z) = layer(q) - z * sum(w)``."""
    scale = weight_scale(w_qp, weight).contiguous()
    float_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    with_zero_point = None
    if folded is not None:
        x_scale, x_zp = folded
        weight_sums = weight.to(torch.int64).flatten(1).sum(1).double()
        shift = (x_scale * x_zp) * scale.double() * weight_sums  # exact integers times two scales, in float64
        folded_bias = ((0.0 if bias is None else bias.detach().double()) - shift).to(torch.float32).contiguous()
        with_zero_point = (folded, folded_bias)
    zero_point = torch.zeros(scale.shape, dtype=torch.int64)
    plain = weight.contiguous() if onednn_direct.available() else None
    return OnednnWeight(packed, scale, zero_point, float_bias, spec, tuple(weight.shape[2:]), int(weight.shape[0]),
                        repack, height_one=height_one, folded=with_zero_point, plain=plain)


def _foldable(weight: torch.Tensor, in_qp: QParams | None) -> tuple[float, int] | None:
    """The input (scale, zero point) to fold into the bias, or None: no input qparams, zero point 0 already, or rows
    whose uncentered sum ``sum(w * q)`` could leave int32. oneDNN's own zero-point correction stays exact whenever
    the centered sum fits (fxquant refuses layers where it does not; tests/robustness/test_invariants.py, k = 131071),
    while a folded zero point is subtracted in float after the int32 sum, so the uncentered sum must fit."""
    if in_qp is None or in_qp.per_channel or in_qp.scalar()[1] == 0:
        return None
    longest = int(weight.to(torch.int64).abs().flatten(1).sum(1).max()) * max(abs(in_qp.qmin), abs(in_qp.qmax))
    return in_qp.scalar() if longest <= 2**31 - 1 else None


def _operands(w: OnednnWeight, qp: QParams) -> tuple[float, int, torch.Tensor | None]:
    """The input scale and zero point the op is called with, and the bias that goes with them: zero point 0 and the
    folded bias for the input qparams the weight was packed for, the real ones otherwise."""
    scale, zero_point = qp.scalar()
    if w.folded is not None and w.folded[0] == (scale, zero_point):
        return scale, 0, w.folded[1]
    return scale, zero_point, w.bias


@functools.lru_cache(maxsize=4096)
def _sees_only_padding(size: int, kernel: int, stride: int, padding: int, dilation: int) -> bool:
    """Whether some output position of this 1-d conv geometry reads padding only."""
    count = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return any(
        all(not 0 <= o * stride - padding + j * dilation < size for j in range(kernel)) for o in range(count)
    )


def _pads_explicitly(shape: tuple[int, ...], w: OnednnWeight) -> bool:
    """Whether an input of ``shape`` must be padded by hand (depth one padded in depth, or outputs that read padding
    only: the first two bugs in the module doc)."""
    assert w.spec is not None, "conv() got weights packed by prepack_linear()"
    spec = w.spec
    if spec.dim == 3 and shape[2] == 1 and spec.padding[0] > 0:
        return True
    geometry = zip(shape[2:], w.kernel, spec.stride, spec.padding, spec.dilation, strict=True)
    return any(_sees_only_padding(*dims) for dims in geometry)


def _one_column(width: int, padding: int, w: OnednnWeight) -> bool:
    """Whether a conv strided along the width outputs one column (the third bug in the module doc)."""
    assert w.spec is not None
    stride, extent = w.spec.stride[-1], w.spec.dilation[-1] * (w.kernel[-1] - 1) + 1
    return stride > 1 and (width + 2 * padding - extent) // stride == 0


def _safe_input(a: torch.Tensor, w: OnednnWeight, zero_point: int) -> tuple[torch.Tensor, list[int], bool]:
    """The input, padding and "drop the extra column" flag that steer clear of the bugs in the module doc."""
    assert w.spec is not None, "conv() got weights packed by prepack_linear()"
    padding = list(w.spec.padding)
    if _pads_explicitly(tuple(a.shape), w):
        a = F.pad(a, [p for pad in reversed(padding) for p in (pad, pad)], value=zero_point)
        padding = [0] * w.spec.dim
    one_column = _one_column(a.shape[-1], padding[-1], w)
    if one_column:
        a = F.pad(a, (0, w.spec.stride[-1]), value=zero_point)
    return a, padding, one_column


def _out_shape(shape: tuple[int, ...], w: OnednnWeight, padding: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The conv output's shape; ``accum`` must match it exactly (the sum post-op does not broadcast)."""
    assert w.spec is not None
    sizes = [(size + 2 * pad - dil * (k - 1) - 1) // stride + 1 for size, k, stride, pad, dil in
             zip(shape[2:], w.kernel, w.spec.stride, padding, w.spec.dilation, strict=True)]
    return (shape[0], w.out_channels, *sizes)


def _direct(w: OnednnWeight) -> torch.Tensor | None:
    """The weight to build a oneDNN primitive from (onednn_direct) for the next call bound for ``w``, or None for the
    torch op: no oneDNN library, or a full cache (building a primitive takes ~0.1-1 ms, and a call past the cache
    binds afresh each time)."""
    return w.plain if len(w.calls) < _CALLS_PER_WEIGHT else None


def _bound(w: OnednnWeight, key: tuple[Any, ...], bind: Callable[[], _Call]) -> _Call:
    """The call ``bind`` makes for ``key`` (input shape and thread count, qparams, output kind), made once per weight.

    Everything about a call but its tensors depends only on the input's shape and the layer's qparams: which
    workaround applies, the weight packed for that shape, the op's 16 other arguments, the clamp after it. Deciding
    that on every call cost ~25 us of Python per layer (an audio1d conv at batch 1: 85 us a call against 59 us for the
    bare op), more than the int8 kernel itself on small layers.
    """
    call = w.calls.get(key)
    if call is None:
        call = bind()
        if len(w.calls) < _CALLS_PER_WEIGHT:
            w.calls[key] = call
    return call


@functools.cache
def _has_uint8_max_pool() -> bool:
    """Whether this torch has ``quantized::max_pool2d`` (it may leave with the quantized dtypes one day)."""
    try:
        torch.ops.quantized.max_pool2d  # noqa: B018  (resolving the op is the check)
    except (AttributeError, RuntimeError):
        return False
    return True


def _pool2d_arguments(dim: int, kwargs: dict[str, Any]) -> tuple[list[int], list[int], list[int], list[int], bool]:
    """``F.max_poolNd`` keyword arguments (dim 1 or 2) as ``quantized::max_pool2d``'s positional ones; 1-d pools
    run over a height of one. Worked out once per pool (``_cached_pool2d_arguments``): ~6 us a call otherwise."""
    try:
        return _cached_pool2d_arguments(dim, tuple(kwargs.items()))
    except TypeError:  # an unhashable value (a list): work it out each time
        return _cached_pool2d_arguments.__wrapped__(dim, tuple(kwargs.items()))


@functools.lru_cache(maxsize=1024)
def _cached_pool2d_arguments(dim: int, items: tuple[tuple[str, Any], ...]) -> tuple[list[int], list[int], list[int],
                                                                                    list[int], bool]:
    kwargs = dict(items)

    def pair(value: Any, default: int) -> list[int]:
        value = default if value is None else value
        values = [value] * dim if isinstance(value, int) else list(value)
        return [default] * (2 - dim) + values if dim == 1 else values

    kernel = pair(kwargs["kernel_size"], 1)
    stride = pair(kwargs.get("stride") or kwargs["kernel_size"], 1)
    return (kernel, stride, pair(kwargs.get("padding"), 0), pair(kwargs.get("dilation"), 1),
            bool(kwargs.get("ceil_mode", False)))


def _clamp(low: int | None, within: QParams | None) -> tuple[int | None, int | None] | None:
    """The clamp after the op: at ``low`` (a ReLU the op could not fuse) and to ``within``'s range where that is
    narrower than oneDNN's [0, 255]; None when there is nothing to clamp."""
    if within is not None and (within.qmin, within.qmax) != UINT8_RANGE:
        return (within.qmin if low is None else max(low, within.qmin)), within.qmax
    return None if low is None else (low, None)


def _clamped(call: _Call, clamp: tuple[int | None, int | None] | None) -> _Call:
    """``call``, its result clamped where ``clamp`` says so."""
    if clamp is None:
        return call

    def clamped(*tensors: torch.Tensor) -> torch.Tensor:
        out = call(*tensors).clamp_(*clamp)
        onednn_direct.record_other()  # a recording of this layer's primitive alone would skip the clamp
        return out

    return clamped


def _finish(op: Any, args: tuple[Any, ...], clamp: tuple[int | None, int | None] | None) -> _Call:
    """``op(a, *args)``, clamped where ``clamp`` says so."""
    return _clamped(lambda a: op(a, *args), clamp)


def _bind_conv(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: tuple[float, int, torch.dtype],
               post_op: str, within: QParams | None) -> _Call:
    """One conv call for inputs of ``shape``: fxquant's own oneDNN primitive (onednn_direct), else
    ``onednn::qconv_pointwise``; ``output``: (scale, zero point, dtype) of the
    result; ``post_op``: a ``_POST_OPS`` name applied to the float result before that; ``within``: the qparams a
    uint8 result must lie in."""
    spec = w.spec
    assert spec is not None, "conv() got weights packed by prepack_linear()"
    x_scale, x_zp, bias = _operands(w, in_qp)
    if w.height_one:
        shape = (shape[0], shape[1], 1, *shape[2:])
    if _pads_explicitly(shape, w) or _one_column(shape[-1], spec.padding[-1], w):
        return lambda a: _qconv_padded(a, w, in_qp, output, post_op, within)
    plain = _direct(w)
    direct = plain is not None and onednn_direct.conv(plain, w.scale, bias, spec, shape,
                                                      _out_shape(shape, w, spec.padding), (x_scale, x_zp), output,
                                                      post_op, w.shared)
    if direct:
        call = _clamped(direct, _clamp(None, within))
    else:
        clamp_after = post_op == "relu" and spec.dim == 3  # the op's conv3d takes no post-op: a clamp after
        attr, algorithm = _POST_OPS["none" if clamp_after else post_op]
        # The op makes its input channels-last itself (a no-op between two convs).
        args: tuple[Any, ...] = (x_scale, x_zp, w.for_input(shape), w.scale, w.zero_point, bias, list(spec.stride),
                                 list(spec.padding), list(spec.dilation), spec.groups, *output, attr, [], algorithm)
        # real zero is the output zero point (0 for a float output)
        call = _finish(torch.ops.onednn.qconv_pointwise, args, _clamp(output[1] if clamp_after else None, within))
    if w.height_one:
        return lambda a: call(a.unsqueeze(2)).squeeze(2)
    return call


def _qconv_padded(a: torch.Tensor, w: OnednnWeight, in_qp: QParams, output: tuple[float, int, torch.dtype],
                  post_op: str, within: QParams | None) -> torch.Tensor:
    """``_bind_conv``'s call for the inputs that need a workaround: padded by hand with the zero point, or one
    column wider with that column dropped after."""
    spec = w.spec
    assert spec is not None
    x_scale, x_zp, bias = _operands(w, in_qp)
    if w.height_one:
        a = a.unsqueeze(2)
    a, padding, one_column = _safe_input(a, w, x_zp)
    clamp_after = post_op == "relu" and spec.dim == 3
    attr, algorithm = _POST_OPS["none" if clamp_after else post_op]
    out = torch.ops.onednn.qconv_pointwise(
        a, x_scale, x_zp, w.packed, w.scale, w.zero_point, bias, list(spec.stride), padding,
        list(spec.dilation), spec.groups, *output, attr, [], algorithm,
    )
    clamp = _clamp(output[1] if clamp_after else None, within)
    if clamp is not None:
        out = out.clamp_(*clamp)
    out = out[..., :1] if one_column else out
    return out.squeeze(2) if w.height_one else out


def _relu(relu: bool) -> str:
    return "relu" if relu else "none"


def _bind_linear(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: tuple[float, int, torch.dtype],
                 post_op: str, within: QParams | None) -> _Call:
    """One Linear call for inputs of ``shape``: fxquant's primitive, else ``onednn::qlinear_pointwise``; arguments
    as for ``_bind_conv``."""
    x_scale, x_zp, bias = _operands(w, in_qp)
    plain = _direct(w)
    direct = plain is not None and onednn_direct.linear(plain, w.scale, bias, shape, (x_scale, x_zp), output,
                                                        post_op, w.shared)
    if direct:
        return _clamped(direct, _clamp(None, within))
    attr, algorithm = _POST_OPS[post_op]
    args: tuple[Any, ...] = (x_scale, x_zp, w.packed, w.scale, w.zero_point, bias, *output, attr, [], algorithm)
    return _finish(torch.ops.onednn.qlinear_pointwise, args, _clamp(None, within))


def _uint8(qp: QParams) -> tuple[float, int, torch.dtype]:
    scale, zero_point = qp.scalar()
    return scale, zero_point, torch.uint8


_FLOAT = (1.0, 0, torch.float32)  # output_dtype float32 with scale 1 / zero point 0: the unrounded float result


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
        # The input shape is only a layout hint; None packs for any batch (measured as fast at batch 1 and 64).
        packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
        # The input zero point folded into the bias, as for unpadded convs (``prepack_conv``): the op at BERT-base's
        # FFN input projection (1024x768 -> 3072, one thread) takes 5.1 ms without one against 6.4 ms with zero
        # point 7 (the zoo's bert_style, hidden 256, is not faster: 24.3 ms a forward either way).
        return PackedWeight(self.name, _onednn_weight(weight, w_qp, bias, packed, folded=_foldable(weight, in_qp)))

    def linear(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
               relu: bool) -> torch.Tensor:
        w: OnednnWeight = packed.payload
        return _bound(w, (a.shape, torch.get_num_threads(), in_qp, out_qp, relu),
                      lambda: _bind_linear(w, tuple(a.shape), in_qp, _uint8(out_qp), _relu(relu), out_qp))(a)

    def linear_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                        relu: bool) -> torch.Tensor:
        w: OnednnWeight = packed.payload
        return _bound(w, (a.shape, torch.get_num_threads(), in_qp, _FLOAT, relu),
                      lambda: _bind_linear(w, tuple(a.shape), in_qp, _FLOAT, _relu(relu), None))(a)

    def linear_unary(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, unary: str,
                     unary_qp: QParams) -> torch.Tensor:
        """The function as the op's post-op: one call, one rounding, no float tensor in between."""
        w: OnednnWeight = packed.payload
        return _bound(w, (a.shape, torch.get_num_threads(), in_qp, unary_qp, unary),
                      lambda: _bind_linear(w, tuple(a.shape), in_qp, _uint8(unary_qp), unary, unary_qp))(a)

    def prepack_conv(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                     in_qp: QParams) -> PackedWeight:
        x_scale, x_zp = in_qp.scalar()
        height_one = spec.dim == 1  # the op's own 1-d path is up to 1.6x slower than a 2-d conv over height 1
        if height_one:
            weight = weight.unsqueeze(2)
            spec = ConvSpec(2, (1, *spec.stride), (0, *spec.padding), (1, *spec.dilation), spec.groups)
        contiguous, scales = weight.contiguous(), weight_scale(w_qp, weight)
        # An input zero point makes oneDNN correct every output for it on every call (measured, one thread: a 1x1
        # conv 320 -> 1280 on 7x7 takes 338 us with zero point 7 and 96 us with 0; 1x32x56x56 -> 192: 185 vs 152 us).
        # Without padding the correction is the same for every output of a channel, so it moves into the bias
        # once: conv(q - z) = conv(q) - z * sum(w). Padded convs keep it (their border outputs sum fewer weights).
        folded = None if any(spec.padding) else _foldable(weight, in_qp)
        pack_zp = 0 if folded else x_zp

        def pack(input_shape: list[int] | None) -> torch.Tensor:
            return torch.ops.onednn.qconv_prepack(contiguous, scales, x_scale, pack_zp, list(spec.stride),
                                                  list(spec.padding), list(spec.dilation), spec.groups, input_shape)

        return PackedWeight(self.name, _onednn_weight(weight, w_qp, bias, pack(None), spec, pack, height_one,
                                                      folded))

    def conv(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
             relu: bool) -> torch.Tensor:
        w: OnednnWeight = packed.payload
        return _bound(w, (a.shape, torch.get_num_threads(), in_qp, out_qp, relu),
                      lambda: _bind_conv(w, tuple(a.shape), in_qp, _uint8(out_qp), _relu(relu), out_qp))(a)

    def conv_to_float(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, *,
                      relu: bool) -> torch.Tensor:
        """``qconv_pointwise`` with ``output_dtype`` float32, scale 1, zero point 0: the unrounded float result."""
        w: OnednnWeight = packed.payload
        return _bound(w, (a.shape, torch.get_num_threads(), in_qp, _FLOAT, relu),
                      lambda: _bind_conv(w, tuple(a.shape), in_qp, _FLOAT, _relu(relu), None))(a)

    def conv_unary(self, a: torch.Tensor, packed: PackedWeight, in_qp: QParams, out_qp: QParams, unary: str,
                   unary_qp: QParams) -> torch.Tensor:
        """As ``linear_unary`` for conv2d (and conv1d, packed as a conv2d); conv3d refuses these post-ops
        ("Unsupported post op swish for quantized pointwise conv3d"), so it runs the unfused sequence."""
        w: OnednnWeight = packed.payload
        assert w.spec is not None, "conv_unary() got weights packed by prepack_linear()"
        if w.spec.dim != 2:
            return super().conv_unary(a, packed, in_qp, out_qp, unary, unary_qp)
        return _bound(w, (a.shape, torch.get_num_threads(), in_qp, unary_qp, unary),
                      lambda: _bind_conv(w, tuple(a.shape), in_qp, _uint8(unary_qp), unary, unary_qp))(a)

    def conv_add(self, a: torch.Tensor, packed: PackedWeight, accum: torch.Tensor, qps: ConvAddQParams, *,
                 relu: bool) -> torch.Tensor:
        """``qconv2d_pointwise.binary`` with the ``sum`` post-op: oneDNN adds ``accum`` to the float conv result
        and rounds once, writing into ``accum`` (channels-last uint8 of the output's shape). Shapes the fused op
        does not take (conv1d, the one-column workaround) run as conv then add."""
        w: OnednnWeight = packed.payload
        fused = _bound(w, (a.shape, torch.get_num_threads(), accum.shape, accum.dtype, qps, relu),
                       lambda: self._bind_conv_add(w, tuple(a.shape), accum, qps, relu))
        return fused(a, accum)

    def _bind_conv_add(self, w: OnednnWeight, shape: tuple[int, ...], accum: torch.Tensor, qps: ConvAddQParams,
                       relu: bool) -> _Call:
        """``conv_add``'s call for inputs of ``shape`` and an ``accum`` like this one: the fused op, or conv then
        add where the fused op does not apply."""
        spec = w.spec
        assert spec is not None, "conv_add() got weights packed by prepack_linear()"
        unfused = functools.partial(super().conv_add, packed=PackedWeight(self.name, w), qps=qps, relu=relu)
        if (w.height_one or len(shape) != 4 or _pads_explicitly(shape, w) or _one_column(shape[-1], spec.padding[-1], w)
                or accum.dtype != torch.uint8 or tuple(accum.shape) != _out_shape(shape, w, spec.padding)):
            return lambda a, accum: unfused(a, accum=accum)
        (x_scale, x_zp, bias), (out_scale, out_zp), (acc_scale, acc_zp) = _operands(w, qps.input), qps.out.scalar(), \
            qps.accum.scalar()
        plain = _direct(w)
        direct = plain is not None and onednn_direct.conv(plain, w.scale, bias, spec, shape, tuple(accum.shape),
                                                          (x_scale, x_zp), _uint8(qps.out), _relu(relu), w.shared,
                                                          accum_qp=(acc_scale, acc_zp))
        if direct:
            return _clamped(direct, _clamp(None, qps.out))
        head = (x_scale, x_zp, w.for_input(shape), w.scale, w.zero_point)
        tail: tuple[Any, ...] = (bias, list(spec.stride), list(spec.padding), list(spec.dilation), spec.groups,
                                 out_scale, out_zp, torch.uint8, acc_scale, acc_zp, "sum", 1.0, _relu(relu), [], "")
        op, clamp = torch.ops.onednn.qconv2d_pointwise.binary, _clamp(None, qps.out)

        def call(a: torch.Tensor, accum: torch.Tensor) -> torch.Tensor:
            # The op requires accum channels-last (a no-op for a conv's output) and makes ``a`` so itself.
            out = op(a, *head, accum.contiguous(memory_format=torch.channels_last), *tail)
            return out if clamp is None else out.clamp_(*clamp)

        return call

    def max_pool(self, a: torch.Tensor, qp: QParams, dim: int, kwargs: dict[str, Any]) -> torch.Tensor:
        """``quantized::max_pool2d`` takes plain uint8 (no quantized dtype) and is ~100x faster on channels-last
        input than aten's uint8 max-pool, which runs contiguous only (see ``PlainInt8Backend.max_pool``)."""
        if dim == 3 or a.dtype != torch.uint8 or not _has_uint8_max_pool():
            return super().max_pool(a, qp, dim, kwargs)
        x = a.unsqueeze(-2) if dim == 1 else a
        batched = x.dim() == 4
        x = (x if batched else x.unsqueeze(0)).contiguous(memory_format=torch.channels_last)
        out = torch.ops.quantized.max_pool2d(x, *_pool2d_arguments(dim, kwargs))
        out = out if batched else out.squeeze(0)
        return out.squeeze(-2) if dim == 1 else out

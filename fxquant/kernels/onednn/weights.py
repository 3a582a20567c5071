"""A layer's weight packed for oneDNN, and the calls bound to it once per input shape.

Packing happens once, at convert: the torch ops' own packed weight (``onednn::qlinear_prepack`` /
``qconv_prepack``), the plain int8 weight for fxquant's own primitives (:mod:`fxquant.kernels.onednn.direct`), and,
where it is exact, the input zero point folded into a float bias. A Linear on fxquant's primitives keeps one int8
copy, the one reordered into oneDNN's layout (:func:`pack_linear`): the plain weight is reordered back from it where
it is read (:meth:`OnednnWeight.unpacked`), and the ops' copy is packed only when a call first needs it
(:meth:`OnednnWeight.op_weight`). Everything a call does besides running its kernel
depends only on the input's shape, the thread count and the layer's qparams, so it is decided once per such key and
kept on the weight (:func:`bound`); what that saves is measured in ``docs/backends.md`` ("What else the backend does").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fxquant.kernels.base import ConvSpec
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.onednn import rows as onednn_rows
from fxquant.kernels.plain_int8 import weight_scale
from fxquant.native.amx_gemm import rows_layout, rows_of_layout
from fxquant.qparams import QParams

SHAPES_PER_WEIGHT = 4  # (input shape, threads) a conv weight is repacked for (e.g. batch 1 and a serving batch)
ROW_BLOCK = 64  # outputs reordered back together for a few rows (oneDNN's int8 layouts block outputs by 64 or less)
CALLS_PER_WEIGHT = 16  # bound calls kept per weight (input shape x threads x output kind); more are built per call
Call = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class OnednnWeight:
    """A oneDNN-packed weight plus the arguments every call repeats.

    A conv weight is packed once for any input (``packed``) and again for each of the first few input shapes it
    meets (``for_input``): oneDNN picks the blocked weight layout by the input shape and the thread count. The
    generic layout is slower on deep layers, a layout packed for another shape slower still, and one packed under
    another thread count makes oneDNN reorder the weight on every call, so each (shape, threads) gets its own
    packing (docs/backends.md, "What else the backend does").
    """

    packed: torch.Tensor | None  # the ops' packed weight; None until op_weight() packs a Linear's from ``plain``
    scale: torch.Tensor
    zero_point: torch.Tensor
    bias: torch.Tensor | None
    spec: ConvSpec | None = None
    kernel: tuple[int, ...] = ()
    out_channels: int = 0
    repack: Callable[[list[int]], torch.Tensor] | None = None
    by_shape: dict[tuple[tuple[int, ...], int], torch.Tensor] = field(default_factory=dict, compare=False)
    height_one: bool = False  # a conv1d packed as a conv2d over a height of one (see ``pack_conv``)
    # (input scale and zero point, bias with that zero point folded in): calls with those input qparams pass zero
    # point 0 and that bias (see ``pack_conv``)
    folded: tuple[tuple[float, int], torch.Tensor] | None = None
    calls: dict[tuple[Any, ...], Call] = field(default_factory=dict, compare=False)  # see ``bound``
    plain: torch.Tensor | None = None  # the int8 weight, contiguous, for primitives built directly (onednn_direct)
    shape: tuple[int, ...] = ()  # the int8 weight's
    shared: list[Any] = field(default_factory=list, compare=False)  # those owning their weights (one per layout)
    # the int8 weight in the AVX2 row loop's layout (``rows``): a Linear's only copy where ``_hold_alone`` put it
    # there, else made for the first call the loop takes
    row_layout: torch.Tensor | None = field(default=None, compare=False)
    # a 3x3 conv's weight transformed for the Winograd kernel (``winograd``), made for the first call it takes
    winograd: torch.Tensor | None = field(default=None, compare=False)
    # a depthwise 3x3 conv's weight in the depthwise loop's layout (``depthwise``), made for the first call it takes
    depthwise: torch.Tensor | None = field(default=None, compare=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> OnednnWeight:
        # The packed tensors are opaque (no storage to copy) and never modified after packing, so copies share them.
        # The bound calls are keyed by the layer's qparams objects, which the copy gets afresh: it binds its own
        # (with the same reordered weights where the layouts match).
        return replace(self, calls={}, shared=list(self.shared))

    def op_weight(self) -> torch.Tensor:
        """The weight packed for the torch ops (``onednn::qlinear_prepack`` for a Linear, packed from the plain
        weight on first use)."""
        if self.packed is None:
            object.__setattr__(self, "packed", torch.ops.onednn.qlinear_prepack(self.unpacked(), None))
            assert self.packed is not None
        return self.packed

    def holds_weight(self) -> bool:
        """Whether the primitives, or the row loop's layout, hold the only int8 copy of the weight
        (:func:`pack_linear`)."""
        return self.plain is None and (bool(self.shared) or self.row_layout is not None)

    def unpacked(self) -> torch.Tensor:
        """The plain int8 weight: ``plain``, or, where the primitives or the row loop's layout hold the only copy, a
        new tensor made back from it (byte for byte: both layouts only move bytes)."""
        if self.plain is not None:
            return self.plain
        assert self.holds_weight(), "packed for the torch ops only: the layer keeps the plain weight"
        if self.row_layout is not None:
            return rows_of_layout(self.row_layout, torch.arange(self.shape[0]), self.shape[1])
        plain = torch.empty(self.shape, dtype=torch.int8)
        self.shared[0].unpack(plain.data_ptr())
        return plain

    def rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """The plain int8 rows of the outputs ``outputs`` (1-d indices; ``IndexError`` outside the weight), read
        back by blocks of :data:`ROW_BLOCK` outputs from the primitives' copy where they hold it: a tied embedding's
        lookup of a decode step reorders one block, not the whole head."""
        if not self.holds_weight():
            return self.unpacked().index_select(0, outputs)
        out_features, in_features = self.shape
        if outputs.numel() and (int(outputs.min()) < 0 or int(outputs.max()) >= out_features):
            raise IndexError("index out of range in self")
        if self.row_layout is not None:
            return rows_of_layout(self.row_layout, outputs, in_features)
        blocks, inverse = torch.unique(outputs.div(ROW_BLOCK, rounding_mode="floor"), return_inverse=True)
        read = torch.empty(len(blocks), ROW_BLOCK, in_features, dtype=torch.int8)
        try:
            for block, first in zip(read, blocks.mul(ROW_BLOCK).tolist(), strict=True):
                self.shared[0].unpack(block.data_ptr(), first, min(ROW_BLOCK, out_features - first))
        except RuntimeError:  # a layout whose blocks of outputs do not divide ROW_BLOCK
            return self.unpacked().index_select(0, outputs)
        return read.view(-1, in_features).index_select(0, inverse * ROW_BLOCK + outputs % ROW_BLOCK)

    def for_input(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The weight packed for inputs of ``shape`` at the current thread count (packed on first use), or the
        generic one past the limit."""
        key = (shape, torch.get_num_threads())
        packed = self.by_shape.get(key)
        if packed is None:
            if self.repack is None or len(self.by_shape) >= SHAPES_PER_WEIGHT:
                return self.op_weight()
            packed = self.by_shape[key] = self.repack(list(shape))
        return packed


def pack_linear(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None,
                in_qp: QParams | None) -> OnednnWeight:
    """A Linear's int8 ``weight`` packed for ``onednn::qlinear_pointwise`` and fxquant's primitives.

    The input shape is only a layout hint to the op; None packs for any batch. The input zero point is folded into
    the bias where that is exact, as for unpadded convs (``pack_conv``): the op runs faster without a zero point.
    With fxquant's primitives the op's copy is packed when a call first needs it (:meth:`OnednnWeight.op_weight`).
    """
    packed = None if onednn_direct.available() else torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
    w = _onednn_weight(weight, w_qp, bias, packed, folded=_foldable(weight, in_qp))
    _hold_alone(w, in_qp)
    return w


def _hold_alone(w: OnednnWeight, in_qp: QParams | None) -> None:
    """Reorder a Linear's weight into oneDNN's layout now and drop the plain copy, which would double the layer's
    int8 bytes. The layout is the one oneDNN picks for one row of input (a decode step; on an AVX512-VNNI CPU the same
    for 1 to 512 rows at one and two threads); later primitives use it, or reorder from a plain copy made back from
    it (``onednn_direct._primitive``). Where the AVX2 row loop would run one row
    (:mod:`~fxquant.kernels.onednn.rows`: 7-bit inputs on a CPU with AVX2 alone), the weight goes into the loop's
    layout instead. The plain copy stays where no
    primitive can be built, or where the reorder back does not give it exactly."""
    if w.plain is None:
        return
    if onednn_rows.takes_one_row(in_qp):
        object.__setattr__(w, "row_layout", rows_layout(w.plain))
        object.__setattr__(w, "plain", None)
        return
    out_features, in_features = w.shape
    primitive = onednn_direct.linear(w.plain, out_features, w.scale, None, (1, in_features), (1.0, 0),
                                     (1.0, 0, torch.float32), "none", w.shared)
    if primitive is None:
        return
    plain = w.plain
    object.__setattr__(w, "plain", None)
    if not torch.equal(w.unpacked(), plain):
        object.__setattr__(w, "plain", plain)


def pack_conv(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec,
              in_qp: QParams) -> OnednnWeight:
    """A conv's int8 ``weight`` packed for ``onednn::qconv_pointwise`` (generic, and per input shape on first use)
    and fxquant's primitives.

    A conv1d is packed as a conv2d over a height of one: the op's own 1-d path is slower and takes no SiLU/hardswish
    post-op. An input zero point makes oneDNN correct every output for it on every call; without padding that
    correction is the same for every output of a channel, so it moves into the bias once:
    ``conv(q - z) = conv(q) - z * sum(w)``. Padded convs keep it (their border outputs sum fewer weights).
    """
    x_scale, x_zp = in_qp.scalar()
    height_one = spec.dim == 1
    if height_one:
        weight = weight.unsqueeze(2)
        spec = ConvSpec(2, (1, *spec.stride), (0, *spec.padding), (1, *spec.dilation), spec.groups)
    contiguous, scales = weight.contiguous(), weight_scale(w_qp, weight)
    folded = None if any(spec.padding) else _foldable(weight, in_qp)
    pack_zp = 0 if folded else x_zp

    def pack(input_shape: list[int] | None) -> torch.Tensor:
        return torch.ops.onednn.qconv_prepack(contiguous, scales, x_scale, pack_zp, list(spec.stride),
                                              list(spec.padding), list(spec.dilation), spec.groups, input_shape)

    return _onednn_weight(weight, w_qp, bias, pack(None), spec, pack, height_one, folded)


def _onednn_weight(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, packed: torch.Tensor | None,
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
                        repack, height_one=height_one, folded=with_zero_point, plain=plain,
                        shape=tuple(weight.shape))


def _foldable(weight: torch.Tensor, in_qp: QParams | None) -> tuple[float, int] | None:
    """The input (scale, zero point) to fold into the bias, or None: no input qparams, zero point 0 already, or rows
    whose uncentered sum ``sum(w * q)`` could leave int32. oneDNN's own zero-point correction stays exact whenever
    the centered sum fits (fxquant refuses layers where it does not; tests/robustness/test_invariants.py, k = 131071),
    while a folded zero point is subtracted in float after the int32 sum, so the uncentered sum must fit."""
    if in_qp is None or in_qp.per_channel or in_qp.scalar()[1] == 0:
        return None
    longest = int(weight.to(torch.int64).abs().flatten(1).sum(1).max()) * max(abs(in_qp.qmin), abs(in_qp.qmax))
    return in_qp.scalar() if longest <= 2**31 - 1 else None


def operands(w: OnednnWeight, qp: QParams) -> tuple[float, int, torch.Tensor | None]:
    """The input scale and zero point the op is called with, and the bias that goes with them: zero point 0 and the
    folded bias for the input qparams the weight was packed for, the real ones otherwise."""
    scale, zero_point = qp.scalar()
    if w.folded is not None and w.folded[0] == (scale, zero_point):
        return scale, 0, w.folded[1]
    return scale, zero_point, w.bias


def direct_weight(w: OnednnWeight) -> onednn_direct.Weight | None:
    """The weight to build a oneDNN primitive from (onednn_direct) for the next call bound for ``w`` (the plain
    weight, or where the primitives hold the only copy, :meth:`OnednnWeight.unpacked`), or None for the torch op:
    no oneDNN library, or a full cache (building a primitive costs far more than a call, and a call past the cache
    binds afresh each time)."""
    if len(w.calls) >= CALLS_PER_WEIGHT:
        return None
    return w.unpacked if w.holds_weight() else w.plain


def bound(w: OnednnWeight, key: tuple[Any, ...], bind: Callable[[], Call]) -> Call:
    """The call ``bind`` makes for ``key`` (input shape and thread count, qparams, output kind), made once per weight.

    Everything about a call but its tensors depends only on the input's shape and the layer's qparams: which
    workaround applies, the weight packed for that shape, the op's 16 other arguments, the clamp after it. Deciding
    that on every call would cost more Python per layer than the int8 kernel itself takes on small layers.
    """
    call = w.calls.get(key)
    if call is None:
        call = bind()
        if len(w.calls) < CALLS_PER_WEIGHT:
            w.calls[key] = call
    return call

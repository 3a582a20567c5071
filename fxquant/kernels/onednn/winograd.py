"""The onednn backend's 3x3 convs of stride 1 as Winograd F(2x2, 3x3), on CPUs with AVX2 alone.

Without VNNI every int8 kernel is bound by its multiplies: oneDNN's sums pairs of u8*s8 products with
``vpmaddubsw`` then ``vpmaddwd``, two multiply instructions per 32 products. Winograd F(2x2, 3x3) computes a 2x2
tile of outputs with 16 products per input channel instead of 36, on transformed inputs and weights that fit int16,
and ``vpmaddwd`` alone multiplies 16 int16 pairs at about the rate of oneDNN's pair (measured: 16.6 against 18.2
GMAC/s on an AMD EPYC Zen 1); the transforms are additions. On that CPU a 3x3 layer takes 0.57-0.78 of oneDNN's
time (docs/backends.md, "3x3 convs as Winograd F(2x2, 3x3)"). The kernel's integer sums are oneDNN's exactly (the
transforms are integer, and the output transform's result, 4x the direct sum, is divided exactly), and it
requantizes as oneDNN's primitive does (``fxquant/native/csrc/onednn_requant.h``): the same bytes as the primitive,
sum post-op included (tests/kernels/test_onednn_winograd.py).

A conv takes it where AVX2 is the highest instruction set fxquant may use and the input is 7-bit (the row loop's
:func:`~fxquant.kernels.onednn.rows.usable`: with VNNI oneDNN's kernel multiplies four bytes per instruction, and
Winograd's int16 products would lose), the layer is a 2-d 3x3 conv of stride 1, dilation 1, one group and padding
of at most 2, on :data:`MIN_CHANNELS` to :data:`MAX_CHANNELS` input channels, with a uint8 output (a ReLU and the
sum post-op fused, a range from 0), torch's thread count is within ``native.THREAD_LIMITS["onednn_winograd"]``, and
the layer keeps the plain weight the transform is made from (as it does for fxquant's own primitives, where the
oneDNN library is loaded).
A call is an :data:`~fxquant.kernels.recording.AddressCall`, so a replayed run holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxquant import native
from fxquant.kernels.onednn.direct import Output, conv_call
from fxquant.kernels.onednn.rows import loop_qmax, onednn_requant, usable
from fxquant.native.winograd import OnednnWinograd, transformed_weight
from fxquant.qparams import QParams

if TYPE_CHECKING:
    from fxquant.kernels.onednn.weights import Call, OnednnWeight

FAMILY = "onednn_winograd"  # its thread limit in native.THREAD_LIMITS
# The kernel's int32 sums are exact to 1827 input channels of 8-bit inputs: a round bound below that.
MAX_CHANNELS = 1024
# Below this, the transforms (and inputs padded to 16 channels) outweigh the products saved: on the Zen 1 EPYC,
# 16 -> 16 channels took 1.04-1.06x oneDNN's time, 3 -> 16 3.5x, 32 -> 16 to 32 -> 64 0.77-0.88x (docs/backends.md).
MIN_CHANNELS = 32


def takes(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams) -> bool:
    """Whether the kernel can run this layer on inputs of ``shape`` (N, C, H, W) and ``in_qp`` now (the output
    aside)."""
    spec = w.spec
    return (spec is not None and spec.dim == 2 and not w.height_one and not spec.transposed and len(shape) == 4
            and w.kernel == (3, 3) and spec.stride == (1, 1) and spec.dilation == (1, 1) and spec.groups == 1
            and max(spec.padding) <= 2 and MIN_CHANNELS <= shape[1] <= MAX_CHANNELS and w.plain is not None
            and min(size + 2 * pad - 2 for size, pad in zip(shape[2:], spec.padding, strict=True)) >= 1
            and usable(in_qp) and native.available(FAMILY))


def winograd_call(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: Output, post_op: str,
                  within: QParams | None, operands: tuple[float, int, torch.Tensor | None],
                  accum_qp: tuple[float, int] | None = None) -> Call | None:
    """The conv on inputs of ``shape`` by the Winograd kernel as ``f(a)`` (``f(a, accum)`` with ``accum_qp``, the
    sum post-op's scale and zero point: the accumulator is overwritten, as oneDNN's primitive does), or None where
    the primitive should run it (see the module docstring); ``output``, ``post_op`` and ``within`` as for
    ``calls.bind_conv``, ``operands`` as for ``rows.row_call``."""
    qmax = loop_qmax(output, post_op, within, (torch.uint8,))
    if qmax is None or not takes(w, shape, in_qp):
        return None
    assert w.spec is not None and w.plain is not None
    layout = w.winograd
    if layout is None:  # one transformed copy per weight, whichever calls share it
        layout = transformed_weight(w.plain)
        object.__setattr__(w, "winograd", layout)
    requant, multipliers, bias = onednn_requant(w, operands, output, post_op, qmax)
    padding = (w.spec.padding[0], w.spec.padding[1])
    run = OnednnWinograd(shape, padding, requant.zx, layout, multipliers, bias, w.out_channels,
                         requant._replace(zx=0), accum_qp)
    call = conv_call(run, (shape[0], w.out_channels, *run.out_size), torch.uint8, accum_qp is not None)
    call.loop = run  # type: ignore[attr-defined]  # (as onednn_direct's calls carry their primitive)
    return call

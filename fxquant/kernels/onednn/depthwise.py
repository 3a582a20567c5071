"""The onednn backend's depthwise 3x3 convs, on CPUs with AVX2 alone.

Without VNNI, oneDNN's depthwise kernel sums 3.2-4.4 G products per second on an AMD EPYC Zen 1, where its 1x1
convs sum 16-18 G: MobileNetV2's 17 depthwise layers took a fifth of the model's time at batch 1 for 7% of its
products. fxquant's loop (``fxquant/native/csrc/depthwise_avx2.c``) multiplies eight channels' pairs of taps per
``vpmaddwd`` on inputs widened to int16: exact integer sums, oneDNN's requantization (``onednn_requant.h``), so the
bytes are the primitive's (tests/kernels/test_onednn_depthwise.py); docs/backends.md, "Depthwise 3x3 convs", has
the measurements.

A conv takes it where AVX2 is the highest instruction set fxquant may use and the input is 7-bit (the row loop's
:func:`~fxquant.kernels.onednn.rows.usable`: where the loop was measured against oneDNN's kernel), the layer is a
2-d 3x3 conv with one group per channel (as many outputs as inputs), stride 1 or 2 in both dims, dilation 1,
padding 0 or 1, channels a multiple of 8, with a uint8 output (a ReLU fused, a range from 0), torch's thread count
is within ``native.THREAD_LIMITS["onednn_depthwise"]``, and the layer keeps its plain weight.
A call is an :data:`~fxquant.kernels.recording.AddressCall`, so a replayed run holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxquant import native
from fxquant.kernels.onednn.direct import Output, conv_call
from fxquant.kernels.onednn.rows import loop_qmax, onednn_requant, usable
from fxquant.native.depthwise import OnednnDepthwise, depthwise_weight
from fxquant.qparams import QParams

if TYPE_CHECKING:
    from fxquant.kernels.onednn.weights import Call, OnednnWeight

FAMILY = "onednn_depthwise"  # its thread limit in native.THREAD_LIMITS


def takes(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams) -> bool:
    """Whether the loop can run this layer on inputs of ``shape`` (N, C, H, W) and ``in_qp`` now (the output
    aside)."""
    spec = w.spec
    return (spec is not None and spec.dim == 2 and not w.height_one and not spec.transposed and len(shape) == 4
            and w.kernel == (3, 3) and spec.groups == shape[1] == w.out_channels and shape[1] % 8 == 0
            and spec.stride in ((1, 1), (2, 2)) and spec.dilation == (1, 1) and max(spec.padding) <= 1
            and min(size + 2 * pad for size, pad in zip(shape[2:], spec.padding, strict=True)) >= 3
            and w.plain is not None and usable(in_qp) and native.available(FAMILY))


def depthwise_call(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: Output, post_op: str,
                   within: QParams | None, operands: tuple[float, int, torch.Tensor | None]) -> Call | None:
    """The conv on inputs of ``shape`` by the loop as ``f(a)``, or None where the primitive should run it (see the
    module docstring); ``output``, ``post_op`` and ``within`` as for ``calls.bind_conv``, ``operands`` as for
    ``rows.row_call``."""
    qmax = loop_qmax(output, post_op, within, (torch.uint8,))
    if qmax is None or not takes(w, shape, in_qp):
        return None
    assert w.spec is not None and w.plain is not None
    layout = w.depthwise
    if layout is None:  # one copy in the loop's layout per weight, whichever calls share it
        layout = depthwise_weight(w.plain)
        object.__setattr__(w, "depthwise", layout)
    requant, multipliers, bias = onednn_requant(w, operands, output, post_op, qmax)
    weight_sums = w.plain.reshape(w.out_channels, 9).sum(1, dtype=torch.int32)
    run = OnednnDepthwise(shape, (w.spec.padding[0], w.spec.padding[1]), w.spec.stride[0], requant.zx, layout,
                          weight_sums, multipliers, bias, requant._replace(zx=0))
    call = conv_call(run, (shape[0], w.out_channels, *run.out_size), torch.uint8, False)
    call.loop = run  # type: ignore[attr-defined]  # (as onednn_direct's calls carry their primitive)
    return call

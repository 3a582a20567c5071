"""One oneDNN Linear/Conv call for one input shape: fxquant's own primitive (or, on CPUs with AVX2 alone, its row
loop or Winograd conv), else the torch op.

Each ``bind_*`` function decides, once per input shape and qparams (:func:`fxquant.kernels.onednn.weights.bound`
keeps the result), which kernel runs, with which weight and arguments, and what clamp follows it. fxquant's
primitives (:mod:`fxquant.kernels.onednn.direct`) compute the ops' own integers; the ops run where the oneDNN
library is missing, refuses a primitive, or an input meets a bug (:mod:`fxquant.kernels.onednn.workarounds`).
The bias stays float and is added after the accumulator is scaled; weight zero points are 0.
"""

from __future__ import annotations

from typing import Any

import torch

from fxquant.kernels.base import ConvAddQParams
from fxquant.kernels.onednn import depthwise as onednn_depthwise
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.onednn import rows as onednn_rows
from fxquant.kernels.onednn import winograd as onednn_winograd
from fxquant.kernels.onednn.direct import Output
from fxquant.kernels.onednn.post_ops import (
    POST_OPS,
    clamp_bounds,
    conv_post_op,
    finish,
    output_clip,
    relu_post_op,
    uint8_output,
)
from fxquant.kernels.onednn.weights import Call, OnednnWeight, direct_weight, operands
from fxquant.kernels.onednn.workarounds import needs_workaround, padded_conv
from fxquant.qparams import QParams


def out_shape(shape: tuple[int, ...], w: OnednnWeight, padding: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The conv output's shape; ``accum`` must match it exactly (the sum post-op does not broadcast)."""
    assert w.spec is not None
    sizes = [(size + 2 * pad - dil * (k - 1) - 1) // stride + 1 for size, k, stride, pad, dil in
             zip(shape[2:], w.kernel, w.spec.stride, padding, w.spec.dilation, strict=True)]
    return (shape[0], w.out_channels, *sizes)


def bind_conv(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: Output, post_op: str,
              within: QParams | None) -> Call:
    """One conv call for inputs of ``shape``: fxquant's own oneDNN primitive (onednn_direct), else
    ``onednn::qconv_pointwise``; ``output``: (scale, zero point, dtype) of the result; ``post_op``: a ``POST_OPS``
    name applied to the float result before that; ``within``: the qparams a uint8 result must lie in."""
    spec = w.spec
    assert spec is not None, "conv() got weights packed by prepack_linear()"
    x_scale, x_zp, bias = operands(w, in_qp)
    if w.height_one:
        shape = (shape[0], shape[1], 1, *shape[2:])
    if needs_workaround(shape, w):
        return lambda a: padded_conv(a, w, in_qp, output, post_op, within)
    loop = (onednn_winograd.winograd_call(w, shape, in_qp, output, post_op, within, (x_scale, x_zp, bias))
            or onednn_depthwise.depthwise_call(w, shape, in_qp, output, post_op, within, (x_scale, x_zp, bias)))
    if loop:
        return loop
    plain = direct_weight(w)  # a conv keeps its plain weight (only a Linear's primitives hold theirs alone)
    direct = isinstance(plain, torch.Tensor) and onednn_direct.conv(plain, w.scale, bias, spec, shape,
                                                                    out_shape(shape, w, spec.padding),
                                                                    (x_scale, x_zp), output, post_op, w.shared,
                                                                    clip=output_clip(within))
    if direct:
        call = direct
    else:
        attr, algorithm, clamp_after = conv_post_op(post_op, spec.dim)
        # The op makes its input channels-last itself (a no-op between two convs).
        args: tuple[Any, ...] = (x_scale, x_zp, w.for_input(shape), w.scale, w.zero_point, bias, list(spec.stride),
                                 list(spec.padding), list(spec.dilation), spec.groups, *output, attr, [], algorithm)
        # real zero is the output zero point (0 for a float output)
        call = finish(torch.ops.onednn.qconv_pointwise, args,
                      clamp_bounds(output[1] if clamp_after else None, within))
    if w.height_one:
        return lambda a: call(a.unsqueeze(2)).squeeze(2)
    return call


def bind_linear(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: Output, post_op: str,
                within: QParams | None) -> Call:
    """One Linear call for inputs of ``shape``: fxquant's primitive, else ``onednn::qlinear_pointwise``; arguments
    as for :func:`bind_conv`."""
    x_scale, x_zp, bias = operands(w, in_qp)
    weight = direct_weight(w)
    rows = weight is not None and onednn_rows.row_call(w, shape, in_qp, output, post_op, within, (x_scale, x_zp, bias))
    if rows:
        return rows
    direct = weight is not None and onednn_direct.linear(weight, w.out_channels, w.scale, bias, shape,
                                                         (x_scale, x_zp), output, post_op, w.shared,
                                                         clip=output_clip(within))
    if direct:
        return direct
    attr, algorithm = POST_OPS[post_op]
    # A per-tensor weight scale goes as one element, not 0-d: on a CPU without VNNI, torch 2.13's op hands oneDNN's
    # gemm matmul a scale it refuses for a 0-d tensor ("could not execute a primitive").
    args: tuple[Any, ...] = (x_scale, x_zp, w.op_weight(), w.scale.reshape(-1), w.zero_point.reshape(-1), bias,
                             *output, attr, [], algorithm)
    return finish(torch.ops.onednn.qlinear_pointwise, args, clamp_bounds(None, within))


def bind_conv_add(w: OnednnWeight, shape: tuple[int, ...], accum: torch.Tensor, qps: ConvAddQParams,
                  relu: bool) -> Call | None:
    """The fused conv + add call ``f(a, accum)`` for inputs of ``shape`` and an ``accum`` like this one (fxquant's
    primitive with the sum post-op, else ``onednn::qconv2d_pointwise.binary``), or None where the fused op does not
    apply: conv1d and 3d, inputs that need a workaround, an ``accum`` not uint8 of the output's exact shape."""
    spec = w.spec
    assert spec is not None, "conv_add() got weights packed by prepack_linear()"
    if (w.height_one or len(shape) != 4 or needs_workaround(shape, w) or accum.dtype != torch.uint8
            or tuple(accum.shape) != out_shape(shape, w, spec.padding)):
        return None
    (x_scale, x_zp, bias), (out_scale, out_zp), (acc_scale, acc_zp) = operands(w, qps.input), qps.out.scalar(), \
        qps.accum.scalar()
    winograd = onednn_winograd.winograd_call(w, shape, qps.input, uint8_output(qps.out), relu_post_op(relu), qps.out,
                                             (x_scale, x_zp, bias), accum_qp=(acc_scale, acc_zp))
    if winograd:
        return winograd
    plain = direct_weight(w)  # a conv keeps its plain weight (only a Linear's primitives hold theirs alone)
    direct = isinstance(plain, torch.Tensor) and onednn_direct.conv(plain, w.scale, bias, spec, shape,
                                                                    tuple(accum.shape), (x_scale, x_zp),
                                                                    uint8_output(qps.out), relu_post_op(relu),
                                                                    w.shared, accum_qp=(acc_scale, acc_zp),
                                                                    clip=output_clip(qps.out))
    if direct:
        return direct
    head = (x_scale, x_zp, w.for_input(shape), w.scale, w.zero_point)
    tail: tuple[Any, ...] = (bias, list(spec.stride), list(spec.padding), list(spec.dilation), spec.groups,
                             out_scale, out_zp, torch.uint8, acc_scale, acc_zp, "sum", 1.0, relu_post_op(relu), [], "")
    op, clamp = torch.ops.onednn.qconv2d_pointwise.binary, clamp_bounds(None, qps.out)

    def call(a: torch.Tensor, accum: torch.Tensor) -> torch.Tensor:
        # The op requires accum channels-last (a no-op for a conv's output) and makes ``a`` so itself.
        out = op(a, *head, accum.contiguous(memory_format=torch.channels_last), *tail)
        return out if clamp is None else out.clamp_(*clamp)

    return call

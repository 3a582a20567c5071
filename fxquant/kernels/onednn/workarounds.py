"""Conv geometries torch 2.13's oneDNN int8 conv gets wrong, and the same convolution computed around each.

Each bug has a regression test in ``tests/kernels/test_onednn_backend.py`` that holds the backend's result on that
geometry to the reference backend (the depth-one conv3d also runs the raw op there, so a torch upgrade that fixes it
shows). Inputs a workaround applies to skip fxquant's own primitives and run ``onednn::qconv_pointwise`` on a changed
input (:func:`padded_conv`): the cost is one copy of the input, and real networks rarely meet these geometries.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fxquant.kernels.onednn.direct import Output
from fxquant.kernels.onednn.post_ops import clamp_bounds, conv_post_op
from fxquant.kernels.onednn.weights import OnednnWeight, operands
from fxquant.qparams import QParams


def depth_one_padded(shape: tuple[int, ...], w: OnednnWeight) -> bool:
    """Bug: conv3d on an input of depth 1 that is padded in depth comes out wrong (every output off, at any batch
    size; e.g. a 2x2x2 or 3x3x3 kernel with padding 1). Geometry: a 3-d conv, input depth 1, depth padding > 0.
    Workaround: pad the input explicitly with its zero point and run the conv unpadded, the same convolution."""
    assert w.spec is not None, "conv() got weights packed by prepack_linear()"
    return w.spec.dim == 3 and shape[2] == 1 and w.spec.padding[0] > 0


def reads_padding_only(shape: tuple[int, ...], w: OnednnWeight) -> bool:
    """Bug: where some output reads padding only, depthwise convs with a channel multiplier come out wrong and
    grouped convs on tiny inputs can crash the process. Geometry: along some dimension, padding past the dilated
    kernel, or an input smaller than the dilation gaps. Workaround: as :func:`depth_one_padded`, the input padded
    explicitly with its zero point and run unpadded."""
    assert w.spec is not None, "conv() got weights packed by prepack_linear()"
    spec = w.spec
    geometry = zip(shape[2:], w.kernel, spec.stride, spec.padding, spec.dilation, strict=True)
    return any(_sees_only_padding(*dims) for dims in geometry)


@functools.lru_cache(maxsize=4096)
def _sees_only_padding(size: int, kernel: int, stride: int, padding: int, dilation: int) -> bool:
    """Whether some output position of this 1-d conv geometry reads padding only."""
    count = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return any(
        all(not 0 <= o * stride - padding + j * dilation < size for j in range(kernel)) for o in range(count)
    )


def pads_explicitly(shape: tuple[int, ...], w: OnednnWeight) -> bool:
    """Whether an input of ``shape`` must be padded by hand (:func:`depth_one_padded`, :func:`reads_padding_only`)."""
    return depth_one_padded(shape, w) or reads_padding_only(shape, w)


def one_output_column(width: int, padding: int, w: OnednnWeight) -> bool:
    """Bug: a conv strided along the width whose output is one column wide (and at least five rows high) comes out
    wrong. Geometry: width stride > 1 and ``(width + 2 * padding - dilated kernel width) // stride == 0``.
    Workaround: ``stride`` more zero-point columns on the right of the input add a second output column, which is
    dropped; the first column sees the same inputs, so it is the same convolution."""
    assert w.spec is not None
    stride, extent = w.spec.stride[-1], w.spec.dilation[-1] * (w.kernel[-1] - 1) + 1
    return stride > 1 and (width + 2 * padding - extent) // stride == 0


def needs_workaround(shape: tuple[int, ...], w: OnednnWeight) -> bool:
    """Whether an input of ``shape`` (as the op sees it: 1-d convs with their height of one) meets any bug here."""
    assert w.spec is not None, "conv() got weights packed by prepack_linear()"
    return pads_explicitly(shape, w) or one_output_column(shape[-1], w.spec.padding[-1], w)


def safe_input(a: torch.Tensor, w: OnednnWeight, zero_point: int) -> tuple[torch.Tensor, list[int], bool]:
    """The input, padding and "drop the extra column" flag that steer clear of the bugs above."""
    assert w.spec is not None, "conv() got weights packed by prepack_linear()"
    padding = list(w.spec.padding)
    if pads_explicitly(tuple(a.shape), w):
        a = F.pad(a, [p for pad in reversed(padding) for p in (pad, pad)], value=zero_point)
        padding = [0] * w.spec.dim
    one_column = one_output_column(a.shape[-1], padding[-1], w)
    if one_column:
        a = F.pad(a, (0, w.spec.stride[-1]), value=zero_point)
    return a, padding, one_column


def padded_conv(a: torch.Tensor, w: OnednnWeight, in_qp: QParams, output: Output, post_op: str,
                within: QParams | None) -> torch.Tensor:
    """The conv call for inputs that need a workaround (:func:`needs_workaround`): ``onednn::qconv_pointwise`` on
    the input padded by hand with the zero point, or one column wider with that column dropped after. Arguments as
    for :func:`fxquant.kernels.onednn.calls.bind_conv`."""
    spec = w.spec
    assert spec is not None
    x_scale, x_zp, bias = operands(w, in_qp)
    if w.height_one:
        a = a.unsqueeze(2)
    a, padding, one_column = safe_input(a, w, x_zp)
    attr, algorithm, clamp_after = conv_post_op(post_op, spec.dim)
    out = torch.ops.onednn.qconv_pointwise(
        a, x_scale, x_zp, w.op_weight(), w.scale, w.zero_point, bias, list(spec.stride), padding,
        list(spec.dilation), spec.groups, *output, attr, [], algorithm,
    )
    clamp = clamp_bounds(output[1] if clamp_after else None, within)
    if clamp is not None:
        out = out.clamp_(*clamp)
    out = out[..., :1] if one_column else out
    return out.squeeze(2) if w.height_one else out

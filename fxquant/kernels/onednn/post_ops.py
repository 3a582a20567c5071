"""What follows a oneDNN int8 layer's sum: the output kind, the post-op and the clamp after the op.

The ops take the *real* output scale and, with ``output_dtype=torch.uint8``, return requantized uint8; a ``"relu"``
post-op clamps at the output zero point. oneDNN saturates to [0, 255], so a narrower declared range (7-bit
activations) needs a clamp after the op, and so does a ReLU the op cannot fuse (conv3d takes no post-op).
fxquant's own primitives clip to the narrower range with one more post-op instead (:func:`output_clip`): no pass
over the output after the call, and a replayed run (:mod:`fxquant.runtime.replay`) can hold the layer.
"""

from __future__ import annotations

from typing import Any

import torch

from fxquant.kernels import recording
from fxquant.kernels.onednn.direct import Clip, Output
from fxquant.kernels.onednn.weights import Call
from fxquant.qparams import UINT8_RANGE, QParams

# fxquant's unary names -> the ops' (post-op, algorithm); both ops round once after it (checked against the
# reference: within one step). qconv has no GELU post-op, and its 3-d form (and its own 1-d one) none of these.
POST_OPS = {"silu": ("swish", ""), "hardswish": ("hardswish", ""), "gelu": ("gelu", "none"),
            "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "none": ("none", "")}
FLOAT_OUTPUT: Output = (1.0, 0, torch.float32)  # output_dtype float32, scale 1, zero point 0: the unrounded result
Clamp = tuple[int | None, int | None]


def uint8_output(qp: QParams) -> Output:
    """The op's output arguments for a uint8 result on ``qp``'s grid."""
    scale, zero_point = qp.scalar()
    return scale, zero_point, torch.uint8


def relu_post_op(relu: bool) -> str:
    return "relu" if relu else "none"


def conv_post_op(post_op: str, dim: int) -> tuple[str, str, bool]:
    """The conv op's (post-op, algorithm) for ``post_op``, and whether a ReLU instead becomes a clamp at the output
    zero point after the op: conv3d takes no post-op."""
    clamp_after = post_op == "relu" and dim == 3
    attr, algorithm = POST_OPS["none" if clamp_after else post_op]
    return attr, algorithm, clamp_after


def clamp_bounds(low: int | None, within: QParams | None) -> Clamp | None:
    """The clamp after the op: at ``low`` (a ReLU the op could not fuse) and to ``within``'s range where that is
    narrower than oneDNN's [0, 255]; None when there is nothing to clamp."""
    if within is not None and (within.qmin, within.qmax) != UINT8_RANGE:
        return (within.qmin if low is None else max(low, within.qmin)), within.qmax
    return None if low is None else (low, None)


def output_clip(within: QParams | None) -> Clip | None:
    """The float bounds of a clip post-op that makes a uint8 result lie in ``within``'s range where that is narrower
    than [0, 255], or None. oneDNN applies post-ops before the output's scale and zero point, so the bounds are the
    range's ends dequantized; the clip's ends requantize to them exactly (a float error far below half a step)."""
    if within is None or (within.qmin, within.qmax) == UINT8_RANGE:
        return None
    scale, zero_point = within.scalar()
    return (within.qmin - zero_point) * scale, (within.qmax - zero_point) * scale


def clamped(call: Call, clamp: Clamp | None) -> Call:
    """``call``, its result clamped where ``clamp`` says so."""
    if clamp is None:
        return call

    def clamped_call(*tensors: torch.Tensor) -> torch.Tensor:
        out = call(*tensors).clamp_(*clamp)
        recording.record_other()  # a recording of this layer's primitive alone would skip the clamp
        return out

    return clamped_call


def finish(op: Any, args: tuple[Any, ...], clamp: Clamp | None) -> Call:
    """``op(a, *args)``, clamped where ``clamp`` says so."""
    return clamped(lambda a: op(a, *args), clamp)

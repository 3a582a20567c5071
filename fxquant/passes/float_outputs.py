"""Which values only float code reads, so that rounding them to int8 buys nothing.

A residual add ``dense(x) + residual`` whose sum feeds a LayerNorm (every transformer block) gains nothing from
running int8: its output is dequantized right away, so an int8 add only rounds three times (the Linear's output, the
float residual it quantizes, the sum) where the float add rounds none. BERT's FFN down-projections output values
up to ~200 where most are single digits; those roundings cost most of the model's INT8 error (measured on
all-MiniLM-L6-v2 in docs/accuracy.md, "A real pretrained encoder"). So such an add stays
float, and the Linear feeding it returns float from its accumulator (``Backend.linear_to_float``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx, nn

from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind, classify, is_mul

_PASS_THROUGH = (OpKind.VALUE, OpKind.STRUCTURAL, OpKind.FIXED)


def only_read_as_float(node: fx.Node, modules: Mapping[str, nn.Module],
                       memo: dict[fx.Node, bool] | None = None) -> bool:
    """Whether every reader of ``node`` computes in float when ``node`` is float: float ops, the graph output,
    layers kept float, metadata reads, and ReLU/pool/reshape nodes and adds whose own readers are all float (an add
    reading float ``node`` then has a float input, so it stays float too: the pre-LN residual stream, where each
    add feeds the next block's LayerNorm and add). A multiply or concatenation may run int8 on another int8 input,
    and a quantized layer reads int8, so either says no. ``memo`` keeps each node's answer within one query, so a
    graph whose readers fan out and join again is walked once, not once per path."""
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = bool(node.users) and all(_read_as_float(user, modules, memo) for user in node.users)
    return memo[node]


def _read_as_float(user: fx.Node, modules: Mapping[str, nn.Module], memo: dict[fx.Node, bool]) -> bool:
    kind = classify(user, modules)
    if kind in (OpKind.FLOAT, OpKind.META):
        return True
    settings = user.meta.get(LAYER_SETTINGS)
    if kind is OpKind.COMPUTE and settings is not None and not settings.quantize:
        return True
    passes = kind in _PASS_THROUGH or (kind is OpKind.BINARY and not is_mul(user))
    return passes and only_read_as_float(user, modules, memo)


def float_residual_add(node: fx.Node, int8: set[fx.Node], modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``node`` is an add (of two tensors) with a float input whose sum only float code reads: it runs
    float (see the module doc). ``int8`` holds the values already int8 at this point of the graph."""
    if classify(node, modules) is not OpKind.BINARY or is_mul(node):
        return False
    inputs = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    return any(a not in int8 for a in inputs) and only_read_as_float(node, modules)

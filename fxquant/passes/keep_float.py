"""Keep chosen layers of a calibrated graph float at convert time, without calibrating again.

``QuantConfig.exclude`` decides at ``prepare`` which layers get observers. The accuracy-budget search
(:mod:`fxquant.tuning.budget`) instead converts one calibrated model many times, each time with a different set of
layers kept float: every observer statistic stays valid, only the lowering changes. For a layer kept float this pass

* reads the float value behind its input observer (no quantize-dequantize round trip), or, when its input is an
  int8 value of an upstream layer, goes through :func:`float_barrier`, a float op where lowering dequantizes;
* keeps its output observer for readers that stay int8 (where a ``Quantize`` is needed anyway) and lets float readers
  (the model output, float ops) read the float value directly;
* marks the node's :class:`~fxquant.config.LayerSettings` ``quantize=False`` so later passes (bias correction) skip it.

Layers the config already excludes may be named too: lowering quantizes an excluded layer anyway when its input is
int8 and the next layer's input observer directly follows it (``lower_to_int8`` does not read ``quantize``), and
the float input given here prevents that.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection
from dataclasses import replace

import torch
from torch import fx

from fxquant.passes._graph import finish, nodes_of, only_user
from fxquant.passes._stats import (
    absorbed_by_producer,
    is_activation_observer,
    is_quantized_layer,
    is_statistics,
    kind_of,
)
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind, tensor_input

REASON = "kept float by the accuracy-budget fallback"


def float_barrier(x: torch.Tensor) -> torch.Tensor:
    """Identity; a float op to lowering, so an int8 value reaching it is dequantized first."""
    return x


def _read_float_input(gm: fx.GraphModule, node: fx.Node) -> None:
    value = tensor_input(node)
    while value is not None and is_statistics(gm, value):
        node.replace_input_with(value, value.args[0])  # type: ignore[arg-type]  # statistics of a float layer: moot
        value = tensor_input(node)
    if value is None:
        return
    if is_activation_observer(gm, value) and not absorbed_by_producer(gm, value):
        node.replace_input_with(value, value.args[0])  # type: ignore[arg-type]
        return
    with gm.graph.inserting_before(node):
        barrier = gm.graph.call_function(float_barrier, (value,))
    node.replace_input_with(value, barrier)


def _stays_int8(gm: fx.GraphModule, user: fx.Node) -> bool:
    """Whether lowering will read ``user``'s input as int8: it is, or leads through int8-preserving ops to, an
    int8 layer / add / cat."""
    if is_statistics(gm, user):
        return any(_stays_int8(gm, u) for u in user.users)
    kind = kind_of(gm, user)
    if kind is OpKind.COMPUTE:
        return is_quantized_layer(user)
    if kind in (OpKind.BINARY, OpKind.JOIN):
        return is_activation_observer(gm, only_user(user))
    if kind in (OpKind.VALUE, OpKind.STRUCTURAL):
        return any(_stays_int8(gm, u) for u in user.users)
    return False


def _release_output(gm: fx.GraphModule, node: fx.Node) -> None:
    observer = only_user(node)
    if not is_activation_observer(gm, observer):
        return
    assert observer is not None
    for user in list(observer.users):
        if not _stays_int8(gm, user):
            user.replace_input_with(observer, node)


def keep_layers_float(gm: fx.GraphModule, patterns: Collection[str], prefix: str = "") -> fx.GraphModule:
    """Keep the quantized layers matching ``patterns`` (fnmatch on ``prefix`` + module path, as in
    ``QuantConfig.exclude``) float.

    ``gm`` is a calibrated prepared graph (a copy: it is changed in place and returned). Example::

        gm = keep_layers_float(copy.deepcopy(prepared), {"fc2"})
    """
    chosen = [node for node in nodes_of(gm) if node.op == "call_module" and LAYER_SETTINGS in node.meta
              and any(fnmatch.fnmatchcase(prefix + str(node.target), pattern) for pattern in patterns)]
    for node in chosen:  # all marked first: whether a value stays int8 depends on every reader's fate
        if is_quantized_layer(node):
            node.meta[LAYER_SETTINGS] = replace(node.meta[LAYER_SETTINGS], quantize=False, reason=REASON)
    for node in chosen:
        _read_float_input(gm, node)
        _release_output(gm, node)
    return finish(gm)

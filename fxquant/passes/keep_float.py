"""Keep chosen layers of a calibrated graph float at convert time, without calibrating again.

``QuantConfig.exclude`` decides at ``prepare`` which layers get observers. The accuracy-budget search
(:mod:`fxquant.tuning.budget`) instead converts one calibrated model many times, each time with a different set of
layers kept float: every observer statistic stays valid, only the lowering changes. For a layer kept float this pass

* reads the float value behind its input observer (no quantize-dequantize round trip), or, when its input is an
  int8 value of an upstream layer, goes through :func:`float_barrier`, a float op where lowering dequantizes;
* keeps its output observer for readers that stay int8 for an int8 layer (where a ``Quantize`` is needed anyway)
  and lets every other reader read the float value directly; so do the observers around it, of the ops between it
  and the next int8 layer (residual adds, SwiGLU's ``act(gate) * up``, lookups): an op that was int8 only because
  its neighbours were goes float with them, and ``keep_float=["*"]`` is the prepared model's float computation;
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
from fxquant.passes.schemes import takes_scheme

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


def _stays_int8(gm: fx.GraphModule, user: fx.Node, memo: dict[fx.Node, bool] | None = None) -> bool:
    """Whether lowering will read ``user``'s input as int8 *for an int8 layer*: it is one, or leads through
    int8-preserving ops (an add, mul or cat whose result is observed, values, sigmoid-like fixed-range ops,
    structure) to one. An add whose
    result reaches only float layers is no reason to stay int8: it goes float with them."""
    memo = {} if memo is None else memo
    if user not in memo:
        memo[user] = False  # graphs have no cycles; this only stops re-walking shared paths
        kind = kind_of(gm, user)
        if is_statistics(gm, user) or is_activation_observer(gm, user) or kind in (OpKind.VALUE, OpKind.FIXED,
                                                                                   OpKind.STRUCTURAL):
            memo[user] = any(_stays_int8(gm, u, memo) for u in user.users)
        elif kind is OpKind.COMPUTE:
            memo[user] = is_quantized_layer(user)
        elif kind in (OpKind.BINARY, OpKind.JOIN):
            observer = only_user(user)
            memo[user] = observer is not None and is_activation_observer(gm, observer) and any(
                _stays_int8(gm, u, memo) for u in observer.users)
    return memo[user]


def _release(gm: fx.GraphModule, observer: fx.Node, memo: dict[fx.Node, bool]) -> None:
    """Readers of ``observer`` that do not stay int8 read the float value behind it, unless it is the output of an
    op that stays int8 (an int8 layer's, or an add's that another reader needs as int8): lowering dequantizes it
    for them, as before."""
    readers = [user for user in observer.users if not _stays_int8(gm, user, memo)]
    producer = observer.args[0]
    if absorbed_by_producer(gm, observer) and (
            is_quantized_layer(producer) or len(readers) < len(observer.users)):  # type: ignore[arg-type]
        return
    for user in readers:
        user.replace_input_with(observer, producer)  # type: ignore[arg-type]


def _connected_observers(gm: fx.GraphModule, chosen: list[fx.Node]) -> list[fx.Node]:
    """The activation observers reachable from the chosen layers without passing through another layer: those of
    the int8 ops around them (residual adds, SwiGLU's product, lookups, the quantizes feeding them) and of the
    float code between, in graph order."""
    seen, queue = set(chosen), list(chosen)
    while queue:
        node = queue.pop()
        for other in (*node.all_input_nodes, *node.users):
            if other in seen or other.op in ("placeholder", "output", "get_attr"):
                continue
            seen.add(other)
            if kind_of(gm, other) is not OpKind.COMPUTE:
                queue.append(other)
    return [node for node in nodes_of(gm) if node in seen and is_activation_observer(gm, node)]


def keep_layers_float(gm: fx.GraphModule, patterns: Collection[str], prefix: str = "", *,
                      scheme: str = "static") -> fx.GraphModule:
    """Keep the quantized layers matching ``patterns`` (fnmatch on ``prefix`` + module path, as in
    ``QuantConfig.exclude``) float, or, with a float-in, float-out ``scheme`` (``"dynamic"``, ``"weight_only"``),
    mark the Linears among them for that scheme (:mod:`fxquant.passes.schemes` swaps them after lowering; around
    them the graph is what it is for float layers).

    ``gm`` is a calibrated prepared graph (a copy: it is changed in place and returned). Example::

        gm = keep_layers_float(copy.deepcopy(prepared), {"fc2"})
    """
    chosen = [node for node in nodes_of(gm) if node.op == "call_module" and LAYER_SETTINGS in node.meta
              and any(fnmatch.fnmatchcase(prefix + str(node.target), pattern) for pattern in patterns)
              and (scheme == "static" or takes_scheme(gm, node))]
    for node in chosen:  # all marked first: whether a value stays int8 depends on every reader's fate
        settings = node.meta[LAYER_SETTINGS]
        if settings.quantize or settings.scheme != "static":
            node.meta[LAYER_SETTINGS] = replace(settings, quantize=False, scheme=scheme,
                                                reason=REASON if scheme == "static" else "")
    for node in chosen:
        _read_float_input(gm, node)
    memo: dict[fx.Node, bool] = {}
    for observer in _connected_observers(gm, chosen):
        _release(gm, observer, memo)
    return finish(gm)

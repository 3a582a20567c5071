"""Statistics observers, and the graph questions the convert-time passes that read them all ask.

A *statistics observer* is an :class:`~fxquant.observers.Observer` (identity module, buffers, ``merge``) whose
statistics feed a convert-time pass rather than quantization parameters: per-channel ranges for SmoothQuant, mean
input windows for bias correction. Being observers, they are calibrated, checkpointed, merged across ranks and saved
in artifacts like every other observer; their ``kind`` is ``"statistics"`` so that code choosing ranges
(``recompute_qparams``) leaves them alone. Convert applies them and removes their nodes before lowering.
"""

from __future__ import annotations

from typing import ClassVar

from torch import fx, nn

from fxquant.observers import Observer
from fxquant.passes._graph import only_user
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind, classify

STATISTICS_KIND = "statistics"


class StatisticsObserver(Observer):
    """Base of observers that collect statistics for a convert-time pass (see the module docstring)."""

    kind: ClassVar[str] = STATISTICS_KIND


def module_of(gm: fx.GraphModule, node: fx.Node | None) -> nn.Module | None:
    if node is None or node.op != "call_module":
        return None
    return gm.get_submodule(str(node.target))


def kind_of(gm: fx.GraphModule, node: fx.Node) -> OpKind:
    """``patterns.classify`` without building the whole module table."""
    module = module_of(gm, node)
    return classify(node, {str(node.target): module} if module is not None else {})


def is_statistics(gm: fx.GraphModule, node: fx.Node | None) -> bool:
    return isinstance(module_of(gm, node), StatisticsObserver)


def is_activation_observer(gm: fx.GraphModule, node: fx.Node | None) -> bool:
    module = module_of(gm, node)
    return isinstance(module, Observer) and module.kind != STATISTICS_KIND


def is_quantized_layer(node: fx.Node) -> bool:
    settings = node.meta.get(LAYER_SETTINGS)
    return settings is not None and bool(settings.quantize)


def absorbed_by_producer(gm: fx.GraphModule, observer: fx.Node) -> bool:
    """Whether lowering folds ``observer`` into its producer (an int8 layer/add/cat's output qparams).

    Otherwise the observer marks a float value entering int8, and lowering turns it into a ``Quantize``.
    """
    producer = observer.args[0] if observer.args else None
    if not isinstance(producer, fx.Node) or only_user(producer) is not observer:
        return False
    kind = kind_of(gm, producer)
    if kind is OpKind.COMPUTE:
        return is_quantized_layer(producer)
    return kind in (OpKind.BINARY, OpKind.JOIN)


def behind_statistics(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The first node from ``node`` down its single-user chain that is not a statistics observer."""
    while is_statistics(gm, node):
        user = only_user(node)
        if user is None:
            break
        node = user
    return node


def drop_statistics_node(gm: fx.GraphModule, node: fx.Node) -> None:
    """Remove a statistics observer's node: its users read its input again (identity, so nothing changes)."""
    source = node.args[0]
    assert isinstance(source, fx.Node)
    node.replace_all_uses_with(source)
    gm.graph.erase_node(node)


def insert_statistics(gm: fx.GraphModule, layer: fx.Node, value: fx.Node, observer: StatisticsObserver,
                      prefix: str) -> None:
    """Call ``observer`` (a new submodule named ``prefix`` + a number) on ``value`` right before ``layer``, which
    reads the observer's output (the same value) in its place."""
    name = unique_name(gm, prefix)
    gm.add_submodule(name, observer)
    with gm.graph.inserting_before(layer):
        statistics = gm.graph.call_module(name, (value,))
    layer.replace_input_with(value, statistics)


def unique_name(gm: fx.GraphModule, prefix: str) -> str:
    index = 0
    while hasattr(gm, f"{prefix}{index}"):
        index += 1
    return f"{prefix}{index}"

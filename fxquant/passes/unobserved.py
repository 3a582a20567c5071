"""Layers that never ran during calibration stay float (``QuantConfig(unobserved="float")``, the default).

A branch the calibration data never takes (``if x.sum() > 0: ... else: ...`` inside an untraceable block, a
mixture-of-experts route, a fallback path) leaves its observers empty: no range to quantize with. Rather than
refuse the whole model, this pass removes every observer that saw no data, so the values there stay float, and marks
the layers on both sides of it float with the reason ``coverage`` shows. Lowering then keeps exactly those ops float
(an op is lowered to INT8 only where its input and output are observed), and the rest of the model is INT8 as
calibrated.
"""

from __future__ import annotations

from dataclasses import replace

from torch import fx

from fxquant.observers import Observer
from fxquant.passes._graph import finish, modules_of, nodes_of
from fxquant.passes._stats import is_quantized_layer, kind_of
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind

REASON = "never ran during calibration"
_PASS_THROUGH = (OpKind.VALUE, OpKind.STRUCTURAL, OpKind.META, OpKind.FIXED)


def _empty_observers(gm: fx.GraphModule) -> list[fx.Node]:
    modules = modules_of(gm)
    return [node for node in nodes_of(gm) if node.op == "call_module"
            and isinstance(modules.get(str(node.target)), Observer) and not modules[str(node.target)].has_data]


def _layers_reading(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The layers that read ``node``'s value, directly or through ops that pass int8 values on."""
    found: list[fx.Node] = []
    for user in node.users:
        kind = kind_of(gm, user)
        if kind is OpKind.COMPUTE:
            found.append(user)
        elif kind in _PASS_THROUGH:
            found += _layers_reading(gm, user)
    return found


def _unobserved(gm: fx.GraphModule) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Each observer that saw no data, with the quantized layers writing or reading its value."""
    found = []
    for observer in _empty_observers(gm):
        producer = observer.args[0]
        layers = _layers_reading(gm, observer)
        if isinstance(producer, fx.Node) and kind_of(gm, producer) is OpKind.COMPUTE:
            layers.append(producer)
        found.append((observer, [layer for layer in layers if is_quantized_layer(layer)]))
    return found


def unobserved_layers(gm: fx.GraphModule, prefix: str = "") -> list[str]:
    """The paths (``prefix`` + module path) of the layers :func:`keep_unobserved_float` keeps float; reads only."""
    return sorted({prefix + str(layer.target) for _, layers in _unobserved(gm) for layer in layers})


def keep_unobserved_float(gm: fx.GraphModule, prefix: str = "") -> fx.GraphModule:
    """Remove the observers of ``gm`` (a calibrated prepared graph, changed in place and returned) that saw no data
    and mark the layers writing or reading their values float."""
    for observer, layers in _unobserved(gm):
        for layer in layers:
            layer.meta[LAYER_SETTINGS] = replace(layer.meta[LAYER_SETTINGS], quantize=False, reason=REASON)
        observer.replace_all_uses_with(observer.args[0])  # type: ignore[arg-type]
        gm.graph.erase_node(observer)
    return finish(gm)

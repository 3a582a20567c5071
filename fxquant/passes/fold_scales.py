"""Fold SmoothQuant's explicit ``ChannelScale`` into the float-in, float-out INT8 Linears that read it.

Where SmoothQuant's ``1/s`` cannot go into the op in front (a residual stream, SwiGLU's product), it stays a
``ChannelScale`` (:mod:`fxquant.passes.smoothquant_divide`), an element-wise op of its own. A dynamic or
weight-only Linear (:mod:`fxquant.nn.schemes`) takes it as its ``input_scale`` instead and multiplies in the pass
that reads its input anyway. Runs on a lowered graph, after :func:`~fxquant.passes.schemes.lower_schemes`.
"""

from __future__ import annotations

from collections import Counter

from torch import fx, nn

from fxquant.nn.fused import Fused
from fxquant.nn.schemes import SchemeLinear
from fxquant.passes._graph import finish, modules_of, nodes_of
from fxquant.passes.keep_float import float_barrier
from fxquant.passes.smoothquant_divide import ChannelScale


def fold_channel_scales(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each SmoothQuant ``ChannelScale`` of ``gm`` whose every reader is a float-in, float-out INT8 Linear into
    those layers' ``input_scale`` and erase it, after erasing each :func:`~fxquant.passes.keep_float.float_barrier`
    whose every reader is one (an identity once lowered: the value it guards is float by then); in place, returns
    ``gm``. The layers multiply their input by the scale in the pass that quantizes it (the same float32 product),
    so it costs no op of its own: a decode step runs one per smoothed input, and SwiGLU's gate and up read one
    between them. An island left as ``x -> layer(x)`` is then unwrapped
    (:func:`~fxquant.passes.schemes.unwrap_layer_islands`)."""
    modules, calls = modules_of(gm), Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
    changed = False
    for node in nodes_of(gm):
        if node.op == "call_function" and node.target is float_barrier and _scheme_readers(node, modules):
            node.replace_all_uses_with(node.all_input_nodes[0])
            gm.graph.erase_node(node)
            changed = True
    for node in nodes_of(gm):
        scale = modules.get(str(node.target)) if node.op == "call_module" else None
        layers = _scheme_readers(node, modules) if isinstance(scale, ChannelScale) else None
        if layers is None or any(calls[str(layer.target)] != 1 for layer in layers):
            continue  # a layer called twice would take the scale into its other calls too
        for layer in layers:
            _scheme_layer(modules.get(str(layer.target))).input_scale = scale.scale  # type: ignore[union-attr]
        node.replace_all_uses_with(node.all_input_nodes[0])
        changed = True
    return finish(gm) if changed else gm


def _scheme_layer(module: nn.Module | None) -> SchemeLinear | None:
    """``module`` if it is a SchemeLinear, the one inside it if it is one fused with its activation, else None."""
    inner = module.inner if isinstance(module, Fused) else module
    return inner if isinstance(inner, SchemeLinear) else None


def _scheme_readers(node: fx.Node, modules: dict[str, nn.Module]) -> list[fx.Node] | None:
    """The nodes reading ``node``'s value if every one calls a SchemeLinear (maybe fused with its activation) without
    an ``input_scale`` on it alone; else None."""
    layers = [user for user in node.users if user.op == "call_module" and len(user.all_input_nodes) == 1
              and (layer := _scheme_layer(modules.get(str(user.target)))) is not None and layer.input_scale is None]
    return layers if layers and len(layers) == len(node.users) else None

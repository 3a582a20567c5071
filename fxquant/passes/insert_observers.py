"""Insert observer ``call_module`` nodes where convert will need quantization parameters.

One observer after every quantizable Linear/Conv (its output range) and after every residual add that joins int8
values, and one on every float value that enters an int8 region. Values that stay int8 through ReLU, pooling or
reshapes need no observer: they keep their producer's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxquant.config import LayerSettings, QuantConfig
from fxquant.meta import LAYER_SETTINGS
from fxquant.nn.fused import compute_module
from fxquant.observers import Observer, get_activation_observer
from fxquant.passes._graph import finish, modules_of, nodes_of
from fxquant.patterns import OpKind, classify, join_inputs, tensor_input

OBSERVER_PREFIX = "observer_"


@dataclass
class _State:
    gm: fx.GraphModule
    int8: set[fx.Node]
    input_observers: dict[fx.Node, fx.Node]
    prefix: str = ""
    count: int = 0


def _new_observer(state: _State, settings: LayerSettings, label: str) -> str:
    cls = get_activation_observer(settings.activation)
    observer: Observer = cls(**settings.observer_options)
    observer.label = label
    name = f"{OBSERVER_PREFIX}{state.count}"
    state.count += 1
    state.gm.add_submodule(name, observer)
    return name


def _observe_output(state: _State, node: fx.Node, settings: LayerSettings, label: str) -> None:
    name = _new_observer(state, settings, f"output of {label}")
    with state.gm.graph.inserting_after(node):
        obs = state.gm.graph.call_module(name, (node,))
    node.replace_all_uses_with(obs, delete_user_cb=lambda user: user is not obs)
    state.int8.add(obs)


def _where(node: fx.Node, prefix: str) -> str:
    """A module path for module calls (what users and configs name), the node name otherwise."""
    return prefix + (str(node.target) if node.op == "call_module" else node.name)


def _observe_input(state: _State, consumer: fx.Node, value: fx.Node, settings: LayerSettings) -> None:
    """Route ``consumer``'s read of float ``value`` through an observer (shared by all int8 consumers)."""
    if value not in state.input_observers:
        name = _new_observer(state, settings, f"{_where(value, state.prefix)} (input of "
                                              f"{_where(consumer, state.prefix)})")
        with state.gm.graph.inserting_before(consumer):
            state.input_observers[value] = state.gm.graph.call_module(name, (value,))
        state.int8.add(state.input_observers[value])
    consumer.replace_input_with(value, state.input_observers[value])


def resolve_layer_settings(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> None:
    """Record each Linear/Conv node's resolved settings in ``node.meta[LAYER_SETTINGS]``.

    ``prefix`` is the path of ``gm`` inside the user's model (for graphs of submodules), so patterns match the
    paths users see.
    """
    modules = modules_of(gm)
    compute = [n for n in nodes_of(gm) if classify(n, modules) is OpKind.COMPUTE]
    for index, node in enumerate(compute):
        position = "first" if index == 0 else "last" if index == len(compute) - 1 else ""
        module_type = type(compute_module(modules[str(node.target)])).__name__
        node.meta[LAYER_SETTINGS] = config.settings_for(prefix + str(node.target), module_type, position=position)


def insert_observers(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """Add observers to ``gm`` (in place) following ``config``; returns ``gm``. See ``resolve_layer_settings``."""
    resolve_layer_settings(gm, config, prefix)
    modules = modules_of(gm)
    state = _State(gm, set(), {}, prefix)
    default = config.settings_for("")
    for node in nodes_of(gm):
        kind = classify(node, modules)
        if kind is OpKind.COMPUTE:
            settings = node.meta[LAYER_SETTINGS]
            value = tensor_input(node)
            if not settings.quantize or value is None:
                continue
            if value not in state.int8:
                _observe_input(state, node, value, settings)
            _observe_output(state, node, settings, prefix + str(node.target))
        elif kind in (OpKind.BINARY, OpKind.JOIN):
            args = join_inputs(node) if kind is OpKind.JOIN else [a for a in node.args[:2] if isinstance(a, fx.Node)]
            if not any(a in state.int8 for a in args):
                continue
            for arg in args:
                if arg not in state.int8:
                    _observe_input(state, node, arg, default)
            _observe_output(state, node, default, prefix + node.name)
        elif kind in (OpKind.VALUE, OpKind.STRUCTURAL) and tensor_input(node) in state.int8:
            state.int8.add(node)
    return finish(gm)


def is_observer_node(node: fx.Node, modules: dict) -> bool:
    return node.op == "call_module" and isinstance(modules.get(str(node.target)), Observer)

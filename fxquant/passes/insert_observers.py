"""Insert observer ``call_module`` nodes where convert will need quantization parameters.

One observer after every quantizable Linear/Conv (its output range) and after every residual add that joins int8
values, and one on every float value that enters an int8 region. Values that stay int8 through ReLU, pooling or
reshapes need no observer: they keep their producer's parameters; sigmoid/tanh outputs have fixed ones. An add that
mixes in a float value and feeds only float code stays float (``float_outputs``).

A float value that will be quantized anyway (an int8 layer or multiply reads it) is quantized once, before the
pools and reshapes that lead from it to other int8 readers, which then run int8 on it: the squeeze-excitation
``x * gate(fc(pool(x)))`` gets one quantize of ``x`` (as in torch.ao), not one of ``x`` and one of ``pool(x)``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from torch import fx

from fxquant.config import LayerSettings, QuantConfig
from fxquant.nn.fused import compute_module
from fxquant.observers import Observer, get_activation_observer
from fxquant.passes._graph import finish, modules_of, nodes_of
from fxquant.passes.float_outputs import float_residual_add
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind, classify, join_inputs, tensor_input
from fxquant.passes.schemes import resolve_scheme

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
    """Record each Linear/Conv node's resolved settings in ``node.meta[LAYER_SETTINGS]`` (a Linear on a float-in,
    float-out scheme with ``quantize=False``: it gets no observers, :func:`~fxquant.passes.schemes.resolve_scheme`).

    ``prefix`` is the path of ``gm`` inside the user's model (for graphs of submodules), so patterns match the
    paths users see.
    """
    modules = modules_of(gm)
    compute = [n for n in nodes_of(gm) if classify(n, modules) is OpKind.COMPUTE]
    for index, node in enumerate(compute):
        position = "first" if index == 0 else "last" if index == len(compute) - 1 else ""
        layer = compute_module(modules[str(node.target)])
        settings = config.settings_for(prefix + str(node.target), type(layer).__name__, position=position)
        node.meta[LAYER_SETTINGS] = resolve_scheme(settings, layer)  # type: ignore[arg-type]


def _int8_reads(node: fx.Node, kind: OpKind, int8: set[fx.Node], modules: dict) -> list[fx.Node] | None:
    """The values ``node`` reads as int8 when it runs int8 (each quantized first if still float); None if it stays
    float. COMPUTE nodes are decided by their settings before this is asked. A residual add that mixes in a float
    value and feeds only float code stays float (``float_outputs.float_residual_add``)."""
    if kind is OpKind.COMPUTE:
        value = tensor_input(node)
        return None if value is None else [value]
    if kind in (OpKind.BINARY, OpKind.JOIN):
        args = join_inputs(node) if kind is OpKind.JOIN else [a for a in node.args[:2] if isinstance(a, fx.Node)]
        if kind is OpKind.BINARY and float_residual_add(node, int8, modules):
            return None
        return args if any(a in int8 for a in args) else None
    return None


def _quantizes_all(node: fx.Node, readers: dict[fx.Node, set[fx.Node]], modules: dict) -> bool:
    """Whether every reader of ``node`` quantizes it, directly or through more pools/reshapes."""
    return bool(node.users) and all(
        user in readers[node] or (classify(user, modules) in (OpKind.VALUE, OpKind.STRUCTURAL)
                                  and _quantizes_all(user, readers, modules)) for user in node.users)


def _hoist_targets(gm: fx.GraphModule, modules: dict) -> set[fx.Node]:
    """Pools/reshapes of a float value that is quantized for another reader anyway, whose own results are only ever
    quantized: they run int8 on that one quantized value instead (see the module doc). A dry run of the loop in
    ``insert_observers`` finds which values get quantized and by whom."""
    int8: set[fx.Node] = set()
    readers: dict[fx.Node, set[fx.Node]] = defaultdict(set)
    for node in nodes_of(gm):
        kind = classify(node, modules)
        settings = node.meta.get(LAYER_SETTINGS)
        reads = None if settings is not None and not settings.quantize else _int8_reads(node, kind, int8, modules)
        if reads is not None:
            for value in reads:
                if value not in int8:
                    readers[value].add(node)
            int8.add(node)
        elif kind in (OpKind.VALUE, OpKind.STRUCTURAL, OpKind.FIXED) and tensor_input(node) in int8:
            int8.add(node)
    return {node for node in nodes_of(gm) if classify(node, modules) in (OpKind.VALUE, OpKind.STRUCTURAL)
            and readers.get(tensor_input(node)) and _quantizes_all(node, readers, modules)}  # type: ignore[arg-type]


def insert_observers(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """Add observers to ``gm`` (in place) following ``config``; returns ``gm``. See ``resolve_layer_settings``."""
    resolve_layer_settings(gm, config, prefix)
    modules = modules_of(gm)
    hoisted = _hoist_targets(gm, modules)
    state = _State(gm, set(), {}, prefix)
    default = config.settings_for("")
    for node in nodes_of(gm):
        kind = classify(node, modules)
        settings = node.meta.get(LAYER_SETTINGS, default)
        reads = _int8_reads(node, kind, state.int8, modules) if settings.quantize else None
        if reads is not None:
            for value in reads:
                if value not in state.int8:
                    _observe_input(state, node, value, settings)
            label = prefix + (str(node.target) if kind is OpKind.COMPUTE else node.name)
            _observe_output(state, node, settings, label)
        elif kind in (OpKind.VALUE, OpKind.STRUCTURAL, OpKind.FIXED) and tensor_input(node) in state.int8:
            state.int8.add(node)
        elif node in hoisted and tensor_input(node) not in state.int8:
            _observe_input(state, node, tensor_input(node), default)  # type: ignore[arg-type]
            state.int8.add(node)
    return finish(gm)


def is_observer_node(node: fx.Node, modules: dict) -> bool:
    return node.op == "call_module" and isinstance(modules.get(str(node.target)), Observer)

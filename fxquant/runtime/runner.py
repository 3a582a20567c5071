"""A converted model's forward without the per-node costs of the code torch.fx generates.

The generated ``forward`` reaches every layer through nested ``getattr`` calls on modules (``nn.Module.__getattr__``)
and ``nn.Module.__call__``, costs of the same order as an INT8 kernel at batch 1. :class:`GraphRunner` walks the same
graph from a list made once: each node's callable and argument slots resolved (one
:class:`~fxquant.runtime.step.Step` per node), each value dropped after its last reader (as the generated code does),
and layers called through ``forward`` directly; consecutive onednn layers, with the one-call int8 steps and views
between them, are one step, replayed as recorded C calls (:mod:`fxquant.runtime.replay`); SDPA calls take fxquant's
attention loops where the model runs INT8 layers on a kernel backend (:mod:`fxquant.runtime.attention`). What each
gains is measured in docs/backends.md ("The graph walk") and docs/benchmarks.md ("Attention over every key").

It behaves as the generated code does, or steps aside:

* hooks on a layer (or global module hooks) and ``torch.jit.trace`` take the ordinary ``module(...)`` call;
* a graph changed and recompiled (``gm.recompile()`` makes new code) is walked anew;
* keyword arguments and defaults follow the placeholders, like the generated signature.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.nn.modules import module as module_globals

from fxquant.runtime import add_norm, attention, replay
from fxquant.runtime.step import Slot, Step, hooked, load, run, slotted
from fxquant.state import STATE_KEY


def _any_global_hooks() -> bool:
    return bool(module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks
                or module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks)


class GraphRunner:
    """``gm``'s forward as a walk over its graph's nodes; install it with :func:`install`."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.plan = self._plan()
        self.__signature__ = self.plan.signature  # inspect.signature(gm.forward) as for the generated code

    def _plan(self) -> _Plan:
        gm = self.gm
        nodes = list(gm.graph.nodes)
        slot = {node: index for index, node in enumerate(nodes)}
        last_use: dict[fx.Node, fx.Node] = {}
        for node in nodes:
            for used in node.all_input_nodes:
                last_use[used] = node
        freed: dict[fx.Node, list[int]] = {}
        for used, user in last_use.items():
            freed.setdefault(user, []).append(slot[used])
        placeholders: list[int] = []
        steps: list[Step] = []
        fast_float = attention.runs_fast(gm)  # INT8 layers on a kernel backend: its float loops (SDPA, add + norm)
        norms = add_norm.pairs(gm) if fast_float else {}  # a + b -> the LayerNorm reading it: one step
        fused_norms = {norm: add for add, norm in norms.items()}
        parameters = []
        output: Any = None
        position: dict[fx.Node, int] = {}
        for node in nodes:
            if node.op == "placeholder":
                if str(node.target).startswith("*"):
                    raise _Unsupported(f"variadic placeholder {node.target}")
                placeholders.append(slot[node])
                default = node.args[0] if node.args else inspect.Parameter.empty
                parameters.append(inspect.Parameter(node.target, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    default=default))
                continue
            if node.op == "output":
                output = slotted(node.args[0], slot)
                position[node] = len(steps)
                break
            if node in fused_norms:  # computed by its add's step
                position[node] = position[fused_norms[node]]
                continue
            position[node] = len(steps)
            if node in norms:
                norm = norms[node]
                step = add_norm.AddLayerNorm(node.target, (slot[node.args[0]], slot[node.args[1]]),
                                             tuple(str(norm.target).split(".")), slot[norm])
                steps.append(Step(slot[norm], "run", step, step.addends, (), {},
                                  tuple(freed.get(node, ())) + tuple(freed.get(norm, ()))))
                continue
            # a module is found on every call, as the generated code does (it may have been replaced since), but
            # through the ``_modules`` dicts: no ``nn.Module.__getattr__`` per level
            target = tuple(node.target.split(".")) if node.op in ("call_module", "get_attr") else node.target
            if fast_float and node.op == "call_function" and node.target in attention.SDPA:
                target = attention.scaled_dot_product_attention
            direct = all(isinstance(arg, fx.Node) for arg in node.args) and not node.kwargs
            steps.append(Step(slot[node], node.op, target, tuple(slot[arg] for arg in node.args) if direct else None,
                              slotted(node.args, slot), slotted(node.kwargs, slot), tuple(freed.get(node, ()))))
        last_read = {slot[used]: position[user] for used, user in last_use.items() if user in position}
        grouped = replay.group(steps, gm, last_read)  # oneDNN layers replayed as one step
        return _Plan(gm.code, len(nodes), tuple(placeholders), placeholders == list(range(len(placeholders))),
                     (None,) * (len(nodes) - len(placeholders)), tuple(grouped), output, inspect.Signature(parameters))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.plan  # one read: a thread that rebuilds it below swaps it whole
        if self.gm.code is not plan.code:  # recompiled since: walk the new graph
            plan = self.plan = self._plan()
            self.__signature__ = plan.signature
            _call_directly(self.gm)  # ``recompile`` sets the class's ``__call__`` too
        if kwargs or len(args) != len(plan.placeholders):
            bound = plan.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        if plan.leading:  # the placeholders are the first nodes, as torch.fx traces them
            env: list[Any] = [*args, *plan.rest]
        else:
            env = [None] * plan.slots
            for index, value in zip(plan.placeholders, args, strict=True):
                env[index] = value
        plain = not (torch._C._get_tracing_state() or _any_global_hooks())
        for index, op, target, direct, node_args, node_kwargs, freed in plan.steps:
            if op == "run":  # consecutive oneDNN layers (fxquant.runtime.replay)
                target(env, self.gm, plain)
                for dead in freed:
                    env[dead] = None
                continue
            if direct is not None:
                call_args: Any = [env[i] for i in direct]
                call_kwargs: dict[str, Any] = {}
            else:
                call_args, call_kwargs = load(node_args, env), load(node_kwargs, env)
            env[index] = run(op, target, call_args, call_kwargs, self.gm, plain)
            for dead in freed:
                env[dead] = None
        return env[plan.output.index] if isinstance(plan.output, Slot) else load(plan.output, env)


class _Plan(NamedTuple):
    code: str  # the generated code this plan was made with (``recompile`` makes a new string)
    slots: int
    placeholders: tuple[int, ...]
    leading: bool  # whether ``placeholders`` are slots 0, 1, ...
    rest: tuple[None, ...]  # the other slots' values before a call
    steps: tuple[Step, ...]
    output: Any
    signature: inspect.Signature


class _Unsupported(Exception):
    """A graph the runner does not walk (the generated code keeps it)."""


def install(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm(...)``, and the INT8 islands inside it (partial tracing), run through :class:`GraphRunner`s; the
    generated code stays ``type(gm).forward``."""
    for module in gm.modules():
        if module is gm or (isinstance(module, fx.GraphModule) and STATE_KEY in module.meta):
            with contextlib.suppress(_Unsupported):
                module.forward = GraphRunner(module)
                _call_directly(module)
    return gm


def _call_directly(gm: fx.GraphModule) -> None:
    """``gm(...)`` through :func:`_call`: set as ``__call__`` of the class torch.fx made for ``gm`` alone
    (``GraphModule.__new__``; a copy gets a class of its own), where ``recompile`` sets a wrapper of
    ``nn.Module.__call__`` that adds context to errors raised in the generated code, which the walk does not run."""
    cls = type(gm)
    if cls.__qualname__.split(".")[-1] == "GraphModuleImpl":  # as GraphModule.__new__ tells its own class
        cls.__call__ = _call  # type: ignore[method-assign]


def _call(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``gm(...)``: its ``forward`` straight away where ``nn.Module.__call__`` would only call it (no hooks on
    ``gm``, no global hooks, no ``gm.compile()``, no ``torch.jit.trace``), else ``nn.Module.__call__``. At batch 1
    with cold caches its two frames cost several microseconds a call (docs/backends.md, "The graph walk")."""
    if gm._compiled_call_impl is None and not (hooked(gm) or _any_global_hooks() or torch._C._get_tracing_state()):
        return gm.forward(*args, **kwargs)
    return nn.Module.__call__(gm, *args, **kwargs)

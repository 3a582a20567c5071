"""One step of a converted model's forward as :class:`~fxquant.runtime.runner.GraphRunner` walks it, and how a step
runs on its own (the runner's loop inlines the same; :mod:`fxquant.runtime.replay` calls it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

from torch import fx, nn
from torch.fx.node import map_aggregate, map_arg


class Step(NamedTuple):
    """A graph node resolved once: where its value goes, what to call and with what, and which values die after it.

    A tuple underneath, so the runner's loop unpacks it as cheaply as a plain tuple; everything else reads the
    fields by name.
    """

    slot: int  # index of the node's value in the runner's value list
    op: str  # the node's opcode, or "run" for consecutive oneDNN layers replayed as one step
    target: Any  # module path as a tuple of names (call_module, get_attr), the callable, or the method name
    inputs: tuple[int, ...] | None  # the argument slots when every argument is a node and there are no kwargs
    args: tuple[Any, ...]  # the node's args with nodes replaced by slots
    kwargs: dict[str, Any]  # the node's kwargs, likewise
    freed: tuple[int, ...]  # slots whose last reader this step is


class Slot:
    """Where a node's value lives in the runner's list."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def slotted(value: Any, slot: dict[fx.Node, int]) -> Any:
    """``value`` (node arguments) with every node replaced by the slot its value will be in."""
    return map_arg(value, lambda node: cast(Any, Slot(slot[node])))


def load(value: Any, env: Any) -> Any:
    """``value`` with every :class:`Slot` replaced by its value in ``env`` (a list, or a dict by slot)."""
    if isinstance(value, Slot):
        return env[value.index]
    if isinstance(value, tuple):
        return tuple(load(item, env) for item in value)
    if isinstance(value, list):
        return [load(item, env) for item in value]
    if isinstance(value, dict):
        return {key: load(item, env) for key, item in value.items()}
    if isinstance(value, slice):
        return slice(load(value.start, env), load(value.stop, env), load(value.step, env))
    return value


def reads(step: Step) -> tuple[int, ...]:
    """The slots ``step`` reads, in argument order, each once."""
    if step.inputs is not None:
        return step.inputs
    found: dict[int, None] = {}
    map_aggregate((step.args, step.kwargs), lambda value: found.setdefault(value.index) if isinstance(value, Slot)
                  else None)
    return tuple(found)


def module_at(gm: nn.Module, path: tuple[str, ...]) -> nn.Module:
    """The submodule at ``path``, found through the ``_modules`` dicts (no ``nn.Module.__getattr__`` per level)."""
    module = gm
    for name in path:
        module = module._modules[name]  # type: ignore[assignment]
    return module


def hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def run_layer(module: nn.Module, args: list[Any], plain: bool, kwargs: dict[str, Any] | None = None) -> Any:
    """``module(*args, **kwargs)``; through ``forward`` directly where ``plain`` (no tracing, no global hooks) and
    the module has no hooks."""
    call: Callable[..., Any] = module.forward if plain and not hooked(module) else module
    return call(*args, **(kwargs or {}))


def run(op: str, target: Any, args: Any, kwargs: dict[str, Any], gm: nn.Module, plain: bool) -> Any:
    """One node's call, its arguments loaded."""
    if op == "call_module":
        return run_layer(module_at(gm, target), args, plain, kwargs)
    if op == "call_function":
        return target(*args, **kwargs)
    if op == "call_method":
        return getattr(args[0], target)(*args[1:], **kwargs)
    value: Any = gm  # get_attr: looked up on every call, as the generated code does
    for name in target:
        value = getattr(value, name)
    return value


def execute(step: Step, env: Any, gm: nn.Module, plain: bool) -> Any:
    """``step``'s value from the values in ``env`` (a list, or a dict by slot)."""
    if step.inputs is not None:
        return run(step.op, step.target, [env[i] for i in step.inputs], {}, gm, plain)
    return run(step.op, step.target, load(step.args, env), load(step.kwargs, env), gm, plain)

"""One step of a converted model's forward as :class:`~fxquant.runtime.runner.GraphRunner` walks it."""

from __future__ import annotations

from typing import Any, NamedTuple


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

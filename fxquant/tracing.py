"""torch.fx tracing with configurable leaf modules and errors that say where tracing failed and what to do."""

from __future__ import annotations

import fnmatch
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxquant.errors import TraceError

_TORCH_DIR = str(Path(torch.__file__).parent)
_FXQUANT_DIR = str(Path(__file__).parent)
_ZOO_DIR = str(Path(__file__).parent / "models")  # the bundled models are user code like any other
log = logging.getLogger(__name__)


class QuantTracer(fx.Tracer):
    """A ``fx.Tracer`` whose leaf modules can be named by module path or class name (fnmatch patterns).

    It also remembers the innermost module being traced when tracing fails, so the error can name it.
    """

    def __init__(self, leaf_modules: Sequence[str] = ()) -> None:
        super().__init__()
        self.leaf_patterns = tuple(leaf_modules)
        self.failed_path: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if any(fnmatch.fnmatchcase(module_qualified_name, p) or type(m).__name__ == p for p in self.leaf_patterns):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_path is None:
                self.failed_path = self.path_of_module(m)
            raise


@dataclass(frozen=True)
class GraphBreak:
    """A submodule torch.fx could not trace, kept as a float black box by partial tracing."""

    path: str
    location: str
    reason: str


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that is not torch's own code: the line the user wrote."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)
              and (f.filename.startswith(_ZOO_DIR) or not f.filename.startswith(_FXQUANT_DIR))]
    return frames[-1] if frames else None


def user_location(exc: BaseException) -> str:
    """``file:line: `source``` of the innermost line of ``exc``'s traceback the user wrote (not torch, not fxquant)."""
    frame = _user_frame(exc)
    return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else "unknown location"


def _failure(exc: BaseException, path: str | None) -> GraphBreak:
    location = user_location(exc)
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return GraphBreak(path or "", location, reason)


def _trace_error(failure: GraphBreak, model: nn.Module) -> TraceError:
    path = failure.path
    where = f"submodule {path!r} ({type(model.get_submodule(path)).__name__})" if path else "the model's forward"
    fix = (f"use QuantConfig(leaf_modules=[{path!r}]) to keep it as a float black box, or exclude it"
           if path else "make the forward traceable (no data-dependent Python control flow), or pass concrete_args "
           "to prepare()")
    return TraceError(f"torch.fx cannot trace {where} at {failure.location}: {failure.reason}. Fix: {fix}.",
                      failure=failure)


def _make_tracer(tracer_class: type[fx.Tracer] | None, leaf_modules: Sequence[str]) -> fx.Tracer:
    if tracer_class is None:
        return QuantTracer(leaf_modules)
    if issubclass(tracer_class, QuantTracer):
        return tracer_class(leaf_modules)
    return tracer_class()


def trace(model: nn.Module, *, leaf_modules: Sequence[str] = (), concrete_args: dict[str, Any] | None = None,
          tracer_class: type[fx.Tracer] | None = None) -> fx.GraphModule:
    """Symbolically trace ``model``; on failure raise ``TraceError`` naming the submodule and source line."""
    tracer = _make_tracer(tracer_class, leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        raise _trace_error(_failure(exc, getattr(tracer, "failed_path", None)), model) from exc
    if concrete_args:
        _default_to_concrete(graph, concrete_args)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _default_to_concrete(graph: fx.Graph, concrete_args: dict[str, Any]) -> None:
    """Make each specialised argument default to its concrete value instead of asserting callers pass it.

    torch.fx keeps the original default and inserts ``torch._assert(arg == value)``; calibration batches and
    example inputs do not carry such flags, so the traced model would reject them.
    """
    for node in graph.find_nodes(op="call_function", target=torch._assert):
        message = str(node.args[1]) if len(node.args) > 1 else ""
        name = message.split(" has been specialized")[0]
        check = node.args[0]
        if name in concrete_args and isinstance(check, fx.Node) and isinstance(check.args[0], fx.Node):
            placeholder = check.args[0]
            graph.erase_node(node)
            graph.erase_node(check)
            placeholder.args = (concrete_args[name],)


def trace_partially(model: nn.Module, *, leaf_modules: Sequence[str] = (), concrete_args: dict[str, Any] | None = None,
                    tracer_class: type[fx.Tracer] | None = None) -> tuple[fx.GraphModule, tuple[GraphBreak, ...]]:
    """Trace ``model``, turning each submodule torch.fx cannot trace into a float leaf, until the rest traces.

    Returns the graph and the breaks (module path, source line, reason), largest traceable parts first: only the
    innermost failing module becomes a leaf, so its siblings and parents are still traced and quantized. A failure
    in the root's own forward cannot be isolated and raises ``TraceError``.
    """
    leaves, breaks = list(leaf_modules), list[GraphBreak]()
    while True:
        try:
            return trace(model, leaf_modules=leaves, concrete_args=concrete_args, tracer_class=tracer_class), \
                tuple(breaks)
        except TraceError as error:
            failure = error.failure
            can_isolate = tracer_class is None or issubclass(tracer_class, QuantTracer)
            if failure is None or not failure.path or failure.path in leaves or not can_isolate:
                raise
            log.warning("fxquant: keeping %s float: torch.fx cannot trace it (%s at %s)", failure.path,
                        failure.reason, failure.location)
            breaks.append(failure)
            leaves.append(failure.path)

"""torch.fx tracing with configurable leaf modules and errors that say where tracing failed and what to do."""

from __future__ import annotations

import fnmatch
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxquant.errors import TraceError

_TORCH_DIR = str(Path(torch.__file__).parent)


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


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that is not torch's own code: the line the user wrote."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    return frames[-1] if frames else None


def describe_trace_failure(exc: BaseException, model: nn.Module, path: str | None) -> str:
    where = f"submodule {path!r} ({type(model.get_submodule(path)).__name__})" if path else "the model's forward"
    frame = _user_frame(exc)
    line = f" at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`" if frame else ""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    fix = (f"QuantConfig(leaf_modules=[{path!r}]) to keep it as a float black box, or exclude it"
           if path else "make the forward traceable (no data-dependent Python control flow), or pass concrete_args")
    return f"torch.fx cannot trace {where}{line}: {reason}. Fix: use {fix}."


def trace(model: nn.Module, *, leaf_modules: Sequence[str] = (), concrete_args: dict[str, Any] | None = None,
          tracer_class: type[fx.Tracer] | None = None) -> fx.GraphModule:
    """Symbolically trace ``model``; on failure raise ``TraceError`` naming the submodule and source line."""
    tracer = tracer_class() if tracer_class is not None else QuantTracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        path = getattr(tracer, "failed_path", None)
        raise TraceError(describe_trace_failure(exc, model, path)) from exc
    name = type(model).__name__
    return fx.GraphModule(tracer.root, graph, name)

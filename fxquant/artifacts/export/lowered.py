"""A converted model made ready for ``torch.export``: a copy on an exportable backend, traced with free batch axes.

Both graph formats start here. ``torch.export`` records the aten ops a model runs on symbolic shapes; what fxquant
runs besides aten ops must be out of the way first:

* the INT8 modules of a *copy* are re-lowered onto a backend whose every op is an aten (or export-registered) op:
  the reference backend (exact integer arithmetic in plain torch: the ``.pt2``) or the QDQ backend (ONNX); the
  user's model keeps its own;
* fxquant's C loops are off while tracing (they are speed, never semantics: every caller has the torch path);
* the graph runner (:mod:`fxquant.runtime.runner`) is removed from the copy, leaving each GraphModule's generated
  code, which ``torch.export`` reads for the argument names;
* the copy returns its output's tensors as a flat tuple (a ``ModelOutput``'s fields in order), and a Hugging Face
  model's copy no KV cache (``use_cache=False``): what loads without transformers.

Batch axes (and the sequence axis of integer token inputs) are exported as ``Dim.AUTO``: free where the model
allows it, fixed where its code fixes them. An example batch of one is widened to two first, since a size-1
example makes export fix the axis.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from fxquant import native
from fxquant.errors import ArtifactError
from fxquant.kernels.base import Backend
from fxquant.nn.quantized import _BackendModule, _QuantizedWeighted
from fxquant.runtime.runner import GraphRunner


@contextlib.contextmanager
def _without_native_loops() -> Iterator[None]:
    loops = native.loops
    native.loops = None
    try:
        yield
    finally:
        native.loops = loops


def relowered_copy(gm: fx.GraphModule, backend: Backend) -> fx.GraphModule:
    """A deep copy of converted ``gm`` with every INT8 module on ``backend`` and no graph runner."""
    twin = copy.deepcopy(gm)
    for name, module in twin.named_modules():
        if isinstance(module.__dict__.get("forward"), GraphRunner):
            del module.__dict__["forward"]  # the generated code: type(module).forward
        if isinstance(module, _BackendModule):
            try:
                module.relower(backend)
            except ArtifactError as exc:
                raise ArtifactError(f"layer {name!r} ({type(module).__name__}) cannot be exported: {exc}") from None
        if isinstance(module, _QuantizedWeighted):
            _unregister_buffers(module)
        _no_cache(module)
    _flat_output(twin)
    return twin.eval()


def _unregister_buffers(module: _QuantizedWeighted) -> None:
    """Keep a layer's int8 weight, scales and bias as plain attributes, not buffers: its forward reads the packed
    copy the backend made (the same tensors where no conversion was needed), and an export saves every buffer,
    used or not, apart from the constants the forward reads: each weight would be stored twice."""
    for name in list(module._buffers):
        value = module._buffers.pop(name)
        object.__setattr__(module, name, value)


def _no_cache(module: nn.Module) -> None:
    """A Hugging Face model of the copy returns no KV cache: the export is the whole-sequence forward, and a file
    loaded without transformers cannot rebuild a ``DynamicCache`` (docs/export.md)."""
    config = getattr(module, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False


def output_tensors(value: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a model's output, flattened in order (a ``ModelOutput``'s fields, nested tuples)."""
    return tuple(leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor))


def _flat_output(gm: fx.GraphModule) -> None:
    """Make ``gm`` return :func:`output_tensors` of what it returned: plain tensors load anywhere."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    with gm.graph.inserting_before(output):
        flat = gm.graph.call_function(output_tensors, (output.args[0],))
    output.args = (flat,)
    gm.recompile()


def _example_for_export(value: Any) -> Any:
    """A tensor whose batch (and token sequence) axis has at least two entries, so export can leave it free."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    axes = _free_axes(value)
    for axis in axes:
        if value.shape[axis] == 1:
            value = torch.cat([value, value], dim=axis)
    return value


def _free_axes(value: torch.Tensor) -> tuple[int, ...]:
    """Axis 0, and axis 1 of integer inputs with two or more axes (token ids, attention masks)."""
    if value.dim() == 0:
        return ()
    token_like = not value.is_floating_point() and value.dim() >= 2
    return (0, 1) if token_like else (0,)


def _dynamic_shapes(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple({axis: torch.export.Dim.AUTO for axis in _free_axes(v)} if isinstance(v, torch.Tensor) and v.dim()
                 else None for v in inputs)


def trace(model: nn.Module, example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` (a :func:`relowered_copy`) with free batch axes; the reason, in one
    line, if the model's own code cannot be exported."""
    inputs = tuple(_example_for_export(v) for v in example_inputs)
    try:
        with _without_native_loops(), torch.no_grad(), quiet():
            return torch.export.export(model, inputs, dynamic_shapes=_dynamic_shapes(inputs), strict=False)
    except ArtifactError:
        raise
    except Exception as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ArtifactError(f"torch.export cannot record this model ({type(exc).__name__}: {reason[:300]}); the "
                            "model's own code must be exportable (docs/export.md, 'What exports')") from None


_NOISY_LOGGERS = ("torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes", "torch.onnx",
                  "onnxscript", "onnx_ir")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Exporters log their progress and every specialization they make; fxquant reports the outcome instead."""
    import logging
    import warnings

    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:  # a failed guard also prints the traced graph to stderr
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def dynamic_axes(program: torch.export.ExportedProgram) -> list[list[int]]:
    """For each user input of ``program``, the axes it left free (symbolic sizes)."""
    axes = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        value = node.meta.get("val")
        shape = getattr(value, "shape", ())
        axes.append([i for i, size in enumerate(shape) if not isinstance(size, int)])
    return axes

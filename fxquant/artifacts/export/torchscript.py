"""``format="torchscript"`` (legacy): a TorchScript file, for fbgemm, qnnpack and reference models.

TorchScript is deprecated in torch 2.13 (``torch.jit.load`` points to ``torch.export``); the ``"export"`` and
``"onnx"`` formats replace it and take every backend's model. It stays for deployments that already load it.

fxquant's INT8 modules call their backend through Python objects, so ``torch.jit.script`` cannot compile them; but
``torch.jit.trace`` records the tensor operations they run. On fbgemm/qnnpack those are ``torch.ops.quantized``
kernels whose prepacked weights are TorchScript objects: tracing needs them reachable as module attributes, so they
are attached for the duration of the trace. The resulting file needs only torch (``torch.jit.load``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

from fxquant.errors import ArtifactError
from fxquant.kernels.base import PackedWeight
from fxquant.state import QuantState

EXTRA_FILE = "fxquant.json"  # in the TorchScript archive: {"engine": ...}, read with torch.jit.load(_extra_files=)
_ATTR = "_fxquant_export_packed"
_INSTEAD = ("export it as format 'export' (.pt2) or 'onnx', which take every backend, or convert for 'fbgemm', "
            "'qnnpack' or 'reference' and export that")


def _script_objects(value: Any) -> Iterator[torch.ScriptObject]:
    """The TorchScript objects in a packed payload: itself, inside tuples/lists, or in a dataclass's fields (a
    transposed conv's ``Transposed`` holds its packed Linear or conv)."""
    if isinstance(value, torch.ScriptObject):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _script_objects(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _script_objects(getattr(value, field.name))


@contextlib.contextmanager
def _packed_weights_as_attributes(model: nn.Module) -> Iterator[None]:
    """Attach every prepacked TorchScript object to the module holding it, so ``torch.jit.trace`` can find it."""
    added: list[tuple[nn.Module, str]] = []
    try:
        for module in model.modules():
            packed = [v for v in vars(module).values() if isinstance(v, PackedWeight)]
            for index, obj in enumerate(o for p in packed for o in _script_objects(p.payload)):
                setattr(module, f"{_ATTR}_{index}", obj)
                added.append((module, f"{_ATTR}_{index}"))
        yield
    finally:
        for module, name in added:
            delattr(module, name)


def _trace(model: fx.GraphModule, example_inputs: tuple[Any, ...], backend: str) -> torch.jit.ScriptModule:
    try:
        with _packed_weights_as_attributes(model), torch.no_grad(), warnings.catch_warnings():
            # torch 2.13 deprecates TorchScript in favour of torch.export, which cannot run the quantized kernels'
            # prepacked weights yet; tracer warnings are about Python branches fxquant's kernels take on constants
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(model, example_inputs, check_trace=False)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ArtifactError(f"backend {backend!r} cannot be exported to TorchScript ({reason}); {_INSTEAD}") from None
    return traced


def write_torchscript(model: fx.GraphModule, state: QuantState, example_inputs: tuple[Any, ...]) -> bytes:
    """The TorchScript bytes of converted ``model``; it loads with plain ``torch.jit.load``, under the engine it
    was made for (recorded in the file as ``fxquant.json``): torch re-packs the weights at load time with the
    process's ``torch.backends.quantized.engine``."""
    backends = {state.backend or state.config.backend, *state.layer_backends.values()}
    if "onednn" in backends:  # checked before tracing: the trace would record the output buffers, not the layers
        raise ArtifactError("backend 'onednn' cannot be exported to TorchScript (its layers run oneDNN primitives "
                            f"that fxquant builds at run time, which a trace cannot record); {_INSTEAD}")
    backend = state.backend or state.config.backend
    traced = _trace(model, example_inputs, backend)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # torch re-packs the weights at load time with the process's quantized engine (x86 by default, which runs
        # some convs on oneDNN and rounds differently): the file says which engine it was made for
        torch.jit.save(traced, buffer, _extra_files={EXTRA_FILE: json.dumps({"engine": backend})})
    return buffer.getvalue()

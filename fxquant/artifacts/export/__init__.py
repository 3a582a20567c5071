"""Export a converted model for deployment where fxquant is not installed (docs/export.md).

Three formats, one entry point (:func:`export`):

* ``"onnx"`` (``.onnx``): QDQ ONNX for ONNX Runtime and every QDQ consumer (:mod:`.onnx`, :mod:`.qdq`);
* ``"export"`` (``.pt2``): a ``torch.export`` ExportedProgram of the reference arithmetic, loaded with plain
  ``torch.export.load`` (:mod:`.program`);
* ``"torchscript"`` (``.pt``, legacy): fbgemm/qnnpack/reference models traced with ``torch.jit.trace``
  (:mod:`.torchscript`).

Each writes its file and then its manifest (:mod:`.sidecar`) next to it, both atomically, and refuses a path that
exists unless told to overwrite: a failed export leaves nothing behind and never replaces a file half-way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxquant.artifacts.export.sidecar import describe, qparams_digest, sidecar_path
from fxquant.errors import ArtifactError, InputError
from fxquant.serialization import atomic_write
from fxquant.state import graph_of, quant_state

FORMATS = {"onnx": ".onnx", "export": ".pt2", "torchscript": ".pt"}
_COMPUTES = {"onnx": "QDQ: QuantizeLinear/DequantizeLinear around float ops, for the consumer's INT8 kernels",
             "export": "the reference backend's integer arithmetic in aten ops",
             "torchscript": "the converted backend's torch.ops.quantized kernels"}


def export_format(path: Path, format: str | None) -> str:
    """``format``, checked, or the one ``path``'s suffix names (``.onnx``, ``.pt2``, ``.pt``)."""
    if format is None:
        by_suffix = {suffix: name for name, suffix in FORMATS.items()}
        if path.suffix not in by_suffix:
            raise InputError(f"cannot tell the export format from {path.name!r}; name the file .onnx, .pt2 or .pt, "
                             f"or name the format ({', '.join(FORMATS)}: --format on the command line)")
        return by_suffix[path.suffix]
    if format not in FORMATS:
        raise InputError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    return format


def export(model: nn.Module, path: str | Path, *, format: str | None = None,
           example_inputs: tuple[Any, ...] | None = None, overwrite: bool = False) -> Path:
    """Write converted ``model`` to ``path`` in ``format`` (default: from the suffix) and its manifest next to it
    (``path`` + ``.fxquant.json``); returns ``path``.

    ``example_inputs`` default to random tensors of the shapes given to ``prepare``; the batch axis (and the
    sequence axis of integer token inputs) stays free where the model allows it. Example::

        fxquant.export(qmodel, "model.onnx")   # onnxruntime.InferenceSession("model.onnx")
        fxquant.export(qmodel, "model.pt2")    # torch.export.load("model.pt2").module()(x)
    """
    path = Path(path)
    chosen = export_format(path, format)
    gm = graph_of(model)  # a drop-in model: the GraphModule behind it
    state = quant_state(gm)
    if state.stage != "converted":
        raise InputError("export() takes a converted model (fxquant.convert(prepared)), not a prepared one")
    for target in (path, sidecar_path(path)):
        if (target.exists() or target.is_symlink()) and not overwrite:
            raise InputError(f"{target} exists; remove it or pass overwrite=True (fxquant export --overwrite)")
    if not path.parent.is_dir():
        raise InputError(f"{path.parent} is not a directory")
    if example_inputs is None:
        with torch.random.fork_rng(devices=[]):
            example_inputs = tuple(spec.make() for spec in state.example_inputs)
    details: dict[str, Any] = {}
    if chosen == "torchscript":
        from fxquant.artifacts.export.torchscript import write_torchscript

        data = write_torchscript(gm, state, example_inputs)
    else:
        from fxquant.artifacts.export.lowered import dynamic_axes

        if chosen == "onnx":
            from fxquant.artifacts.export.onnx import OPSET, write_onnx

            data, program = write_onnx(gm, example_inputs)
            details["opset"] = OPSET
        else:
            from fxquant.artifacts.export.program import write_program

            data, program = write_program(gm, example_inputs)
        details["dynamic_axes"] = dynamic_axes(program)
    manifest = describe(data, path, export_format=chosen, computes=_COMPUTES[chosen],
                        backend=state.backend or state.config.backend, layer_backends=state.layer_backends,
                        qparams_sha256=qparams_digest(gm), inputs=[{"shape": list(s.shape), "dtype": s.dtype}
                                                                   for s in state.example_inputs], **details)
    _write_pair(path, data, manifest)
    return path


def _write_pair(path: Path, data: bytes, manifest: dict[str, Any]) -> None:
    """The export, then its manifest; if the manifest cannot be written, the export is removed again."""
    import json

    atomic_write(path, data)
    try:
        atomic_write(sidecar_path(path), (json.dumps(manifest, indent=2) + "\n").encode())
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise ArtifactError(f"cannot write {sidecar_path(path)} ({exc}); nothing was exported") from None


__all__ = ["FORMATS", "export", "export_format"]

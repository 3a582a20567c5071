"""The manifest written next to every export (``model.onnx`` -> ``model.onnx.fxquant.json``).

An exported file leaves fxquant behind; its sidecar says where it came from: the fxquant, torch (and onnx) versions
that wrote it, the backend the model was converted for and the arithmetic the file computes, the example-input
shapes and which axes stay free, and a SHA-256 of every layer's scales and zero points, so two exports can be told
apart (or matched to a run directory) without loading either. ``fxquant inspect FILE`` reads it and checks the
file's own SHA-256 against it. Like the run-directory manifest it is plain JSON: nothing in it is executed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxquant.errors import ArtifactError
from fxquant.nn.quantized import _QuantizedWeighted
from fxquant.qparams import QParams
from fxquant.serialization import sha256_bytes, sha256_file

FORMAT = "fxquant-export"
FORMAT_VERSION = 1
SUFFIX = ".fxquant.json"
MAX_BYTES = 1 << 20


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def _qparams_in(value: Any) -> list[QParams]:
    if isinstance(value, QParams):
        return [value]
    if isinstance(value, (list, tuple)):
        return [qp for item in value for qp in _qparams_in(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [qp for f in dataclasses.fields(value) for qp in _qparams_in(getattr(value, f.name))]
    return []


def qparams_digest(model: nn.Module) -> str:
    """SHA-256 over every INT8 layer's qparams (path, attribute, scale and zero-point bytes, range, axis), in order:
    the layers, not the modules between them, which differ from backend to backend (fbgemm's extra dequantizes)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        if not isinstance(module, _QuantizedWeighted):
            continue
        for attribute, value in vars(module).items():
            for qp in _qparams_in(value):
                digest.update(f"{name}.{attribute}:{qp.qmin}:{qp.qmax}:{qp.axis}:".encode())
                digest.update(qp.scale.detach().to(torch.float32).contiguous().numpy().tobytes())
                digest.update(qp.zero_point.detach().to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def describe(data: bytes, path: Path, *, export_format: str, computes: str, **details: Any) -> dict[str, Any]:
    """The sidecar's content for the export ``data`` about to be written at ``path``."""
    from fxquant._version import __version__

    versions = {"fxquant": __version__, "torch": torch.__version__}
    if export_format == "onnx":
        import onnx

        versions["onnx"] = onnx.__version__
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "export_format": export_format,
            "file": path.name, "sha256": sha256_bytes(data), "bytes": len(data), "computes": computes,
            "versions": versions, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **details}


def read_sidecar(path: Path) -> tuple[dict[str, Any], str]:
    """The manifest of the export at ``path`` (the export itself or its sidecar) and the export file's status:
    "ok (SHA-256 verified)" or what is wrong with it."""
    manifest_path = path if path.name.endswith(SUFFIX) else sidecar_path(path)
    if not manifest_path.is_file():
        raise ArtifactError(f"{path} has no {manifest_path.name} next to it; give a file written by fxquant export")
    if manifest_path.stat().st_size > MAX_BYTES:
        raise ArtifactError(f"{manifest_path} is larger than an fxquant export manifest can be")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ArtifactError(f"{manifest_path} is not valid JSON; the file is truncated or corrupt") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("file"), str):
        raise ArtifactError(f"{manifest_path} is not an fxquant export manifest (no \"format\": \"{FORMAT}\")")
    exported = manifest_path.with_name(Path(manifest["file"]).name)
    if not exported.is_file():
        return manifest, f"BAD: {exported} is missing"
    if sha256_file(exported) != manifest.get("sha256"):
        return manifest, f"BAD: {exported} does not match the SHA-256 in its manifest (modified or replaced)"
    return manifest, "ok (SHA-256 verified)"

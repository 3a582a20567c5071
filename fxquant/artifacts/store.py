"""Committing an artifact directory: content-addressed tensor files first, the manifest last.

A tensor file is named after its role and hash (``observers-3f2a....pt``), so a new stage never overwrites a file the
current manifest names. Renaming the new manifest into place is the one atomic switch; files only the old manifest
named are removed afterwards. If anything fails before that rename, the files written so far are removed and the
directory is exactly as it was.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from fxquant.artifacts.manifest import MANIFEST_NAME, Manifest, read_manifest, verify_file
from fxquant.errors import ArtifactError, FxQuantError
from fxquant.serialization import atomic_write, load_tensors, sha256_bytes, sha256_file, tensor_bytes

_HASH_CHARS = 16


def _previous_files(directory: Path) -> set[str]:
    if not (directory / MANIFEST_NAME).is_file():
        return set()
    with contextlib.suppress(FxQuantError):
        return {entry["name"] for entry in read_manifest(directory).files.values()}
    return set()


def _write_tensor_file(directory: Path, role: str, obj: Any) -> tuple[dict[str, Any], bool]:
    """Write ``obj`` as ``<role>-<hash>.pt`` unless that exact file exists; returns (its files entry, written)."""
    data = tensor_bytes(obj)
    digest = sha256_bytes(data)
    name = f"{role}-{digest[:_HASH_CHARS]}.pt"
    entry: dict[str, Any] = {"name": name, "sha256": digest, "bytes": len(data)}
    path = directory / name
    if path.is_file() and not path.is_symlink() and path.stat().st_size == len(data) and sha256_file(path) == digest:
        return entry, False
    atomic_write(path, data)
    return entry, True


def commit(directory: str | Path, manifest: Manifest, tensors: dict[str, Any] | None = None) -> None:
    """Write ``tensors`` (role -> state dict) and then ``manifest`` into ``directory`` (created if needed).

    Roles not in ``tensors`` keep the files the manifest already names.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ArtifactError(f"{directory} is a file; an artifact is a directory (give a new or existing directory)")
    directory.mkdir(parents=True, exist_ok=True)
    previous = _previous_files(directory)
    written: list[Path] = []
    try:
        for role, obj in (tensors or {}).items():
            entry, new = _write_tensor_file(directory, role, obj)
            written += [directory / entry["name"]] if new else []
            manifest.files[role] = entry
        manifest.write(directory)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    current = {entry["name"] for entry in manifest.files.values()}
    for name in previous - current:
        (directory / name).unlink(missing_ok=True)


def load_role(directory: Path, manifest: Manifest, role: str) -> dict[str, Any]:
    """The verified (hash-checked, ``weights_only``) state dict playing ``role`` in the artifact."""
    state = load_tensors(verify_file(directory, manifest, role), zip_only=True)
    if not isinstance(state, dict):
        raise ArtifactError(f"{directory}: the {role} file holds a {type(state).__name__}, not a state dict")
    return state

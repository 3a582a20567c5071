"""Reading and writing tensor files safely.

Loading never executes code from the file: tensors load with ``torch.load(weights_only=True)``, which refuses any
pickled object other than tensors and plain containers; a zip archive (torch's format) is refused before loading
when its entries would expand beyond the file's own size (torch never compresses, so only a zip bomb does).
Writing goes to a temporary file in the same directory that is then renamed over the target (``os.replace`` is
atomic on POSIX and Windows), so an interrupted write never leaves a partial file behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fxquant.errors import ArtifactError

_CHUNK = 1 << 20


def check_archive(path: Path, *, zip_only: bool = False) -> None:
    """Refuse a zip archive whose entries declare more bytes than the file holds (a zip bomb) before torch reads it.

    ``zip_only``: also refuse torch's legacy (pre-zip) format, which fxquant never writes; for files in artifacts.
    """
    if not path.is_file():
        return  # the caller's own "no such file" says it better
    if not zipfile.is_zipfile(path):
        if zip_only:
            raise ArtifactError(f"{path}: not a torch zip archive (fxquant writes only those); refused to load")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(entry.file_size for entry in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: corrupt tensor archive ({exc})") from None
    if declared > path.stat().st_size:
        raise ArtifactError(f"{path}: refused to load; its zip entries expand to {declared} bytes from a "
                            f"{path.stat().st_size}-byte file (torch writes them uncompressed: a zip bomb?)")


def load_tensors(path: str | Path, *, zip_only: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: a file that needs arbitrary unpickling is refused, so is a zip bomb."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file")
    check_archive(path, zip_only=zip_only)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unsupported content"
        raise ArtifactError(f"{path}: refused to load; it holds objects other than tensors ({first}). fxquant "
                            "never executes code from a file: save plain tensors / state dicts") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: corrupt or truncated tensor file ({exc})") from None


def tensor_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` as bytes: the content is hashed before it is written, so the manifest can name it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256, read in chunks (weights files can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def state_dict_sha256(state: dict[str, Any]) -> str:
    """A hash of a state dict's names, dtypes, shapes and values: equal hashes mean identical weights."""
    digest = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        if not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{key}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@contextlib.contextmanager
def _temporary_sibling(path: Path) -> Iterator[Path]:
    """A temporary file next to ``path`` (same filesystem, so the final rename is atomic); removed on failure."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    temp = Path(name)
    try:
        yield temp
    finally:
        temp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old content or the new, never a mix."""
    path = Path(path)
    with _temporary_sibling(path) as temp:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)

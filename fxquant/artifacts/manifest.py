"""The JSON manifest of an artifact directory: what was made, from what, by which versions, and file hashes.

The manifest is the single commit point of an artifact: tensor files are content-addressed (their name carries
their hash), so writing a new stage never overwrites a file the current manifest names, and renaming the new
manifest into place switches atomically from the old artifact to the new one.

The manifest carries a checksum of its own content. It protects against accidental edits and truncation (a
hand-edited config would silently disagree with the saved statistics), not against an attacker, who could
recompute it; safety against malicious files comes from never unpickling anything but tensors, and from reading
only what the manifest can name safely: a manifest of bounded size, tensor files that are plain regular files
directly inside the directory (no path separators, no symbolic links) of the size it declares. What may be
*imported* for a run directory is decided outside it (:mod:`fxquant.cli.trust`), never by the manifest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import re
import stat
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from fxquant.config import QuantConfig
from fxquant.errors import ArtifactError
from fxquant.serialization import atomic_write, sha256_bytes, sha256_file
from fxquant.state import NONE, InputSpec

FORMAT = "fxquant-artifact"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STAGES = ("prepared", "calibrated", "converted")
MAX_MANIFEST_BYTES = 64 << 20  # graph summaries of a large model are a few MiB; a bigger manifest is not ours
MAX_INPUT_ELEMENTS = 1 << 30  # per example input rebuilt from its spec: refuse to allocate more
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # one path component: no separators, no "..", no dotfile


def _fxquant_version() -> str:
    from fxquant._version import __version__

    return __version__


@dataclass
class Manifest:
    """Everything needed to rebuild a model from its float original; see docs/cli.md for the field list."""

    stage: str
    config: dict[str, Any]
    example_inputs: list[dict[str, Any]]
    graphs: dict[str, list[str]] = field(default_factory=dict)  # "prepared"/"converted" -> graph_summary lines
    fingerprints: dict[str, str] = field(default_factory=dict)  # same keys -> SHA-256 of those lines
    backend: str | None = None
    layer_backends: dict[str, str] = field(default_factory=dict)  # backend "auto": each layer's, replayed on load
    keep_float: list[str] = field(default_factory=list)  # convert(keep_float=...) patterns, replayed on load
    schemes: dict[str, str] = field(default_factory=dict)  # convert(schemes=...) pattern -> scheme, replayed too
    smoothquant_alphas: dict[str, float | None] = field(default_factory=dict)  # "auto"'s choices, replayed too
    calibration_samples: int = 0
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> {"name", "sha256", "bytes"}
    source: dict[str, Any] | None = None  # CLI run dirs: model spec, weights file and hash, example-input spec
    history: list[dict[str, Any]] = field(default_factory=list)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    fxquant_version: str = field(default_factory=_fxquant_version)
    torch_version: str = torch.__version__
    python_version: str = platform.python_version()

    def quant_config(self) -> QuantConfig:
        return QuantConfig.from_dict(self.config, source="the artifact's manifest")

    def input_specs(self) -> tuple[InputSpec, ...]:
        """The example inputs' shapes and dtypes, checked: a manifest must not name any attribute of torch as a dtype
        or make ``load`` allocate an absurd tensor."""
        specs = []
        for spec in self.example_inputs:
            shape, dtype = (spec.get("shape"), spec.get("dtype")) if isinstance(spec, dict) else (None, None)
            if not (isinstance(dtype, str) and (dtype == NONE or isinstance(getattr(torch, dtype, None), torch.dtype))
                    and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                    and math.prod(shape) <= MAX_INPUT_ELEMENTS):
                raise ArtifactError(f"the manifest's example-input spec {spec!r} is not a shape and torch dtype "
                                    f"of at most {MAX_INPUT_ELEMENTS} elements")
            specs.append(InputSpec(tuple(shape), dtype))
        return tuple(specs)

    def record(self, stage: str, **details: Any) -> None:
        """Move to ``stage`` and append it, with when and what, to the history."""
        self.stage = stage
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.history.append({"stage": stage, "at": when, "fxquant_version": _fxquant_version(), **details})

    def to_dict(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        return {**body, "checksum": checksum(body)}

    def write(self, directory: Path) -> None:
        self.fxquant_version, self.torch_version = _fxquant_version(), torch.__version__
        atomic_write(directory / MANIFEST_NAME, (json.dumps(self.to_dict(), indent=2) + "\n").encode())


def input_spec_dicts(specs: tuple[InputSpec, ...]) -> list[dict[str, Any]]:
    return [{"shape": list(s.shape), "dtype": s.dtype} for s in specs]


def checksum(body: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a manifest body (everything but the checksum itself)."""
    return sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def read_manifest(directory: str | Path) -> Manifest:
    """Read and check ``directory/manifest.json``: format, version, checksum and fields."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file() and not path.is_symlink():
        what = "is not a directory" if not Path(directory).is_dir() else f"has no {MANIFEST_NAME}"
        raise ArtifactError(f"{directory} {what}; give a directory written by fxquant.save or fxquant prepare")
    regular_file(path, "the manifest", limit=MAX_MANIFEST_BYTES)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason = exc if not isinstance(exc, RecursionError) else "nested too deeply"
        raise ArtifactError(f"{path} is not valid JSON ({reason}); the file is truncated or corrupt") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not an fxquant manifest (no \"format\": \"{FORMAT}\")")
    _check_version(path, data)
    stored = data.pop("checksum", None)
    if stored != checksum(data):
        raise ArtifactError(f"{path} was modified after fxquant wrote it (checksum mismatch); re-run the stage "
                            "that produced it instead of editing the manifest")
    try:
        manifest = Manifest(**data)
    except TypeError as exc:
        raise ArtifactError(f"{path}: unexpected manifest fields ({exc})") from None
    if manifest.stage not in STAGES:
        raise ArtifactError(f"{path}: unknown stage {manifest.stage!r}; expected one of {', '.join(STAGES)}")
    _check_types(path, manifest)
    _check_file_entries(path, manifest.files)
    return manifest


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "config": (dict,), "example_inputs": (list,), "graphs": (dict,), "fingerprints": (dict,),
    "backend": (str, type(None)), "layer_backends": (dict,), "keep_float": (list,), "schemes": (dict,),
    "smoothquant_alphas": (dict,),
    "calibration_samples": (int,),
    "source": (dict, type(None)), "history": (list,)}


def _check_types(path: Path, manifest: Manifest) -> None:
    """Fields of the wrong JSON type are refused here, not met later as a traceback."""
    for name, types in _FIELD_TYPES.items():
        if not isinstance(getattr(manifest, name), types):
            raise ArtifactError(f"{path}: the field {name!r} holds a {type(getattr(manifest, name)).__name__}; "
                                "the file was not written by fxquant")
    if not all(isinstance(step, dict) for step in manifest.history):
        raise ArtifactError(f"{path}: the history holds entries that are not objects")
    if not all(alpha is None or (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 <= alpha <= 1)
               for alpha in manifest.smoothquant_alphas.values()):
        raise ArtifactError(f"{path}: smoothquant_alphas holds values that are not alphas in [0, 1] or null; the "
                            "file was not written by fxquant")


def _check_file_entries(path: Path, files: Any) -> None:
    """Every file the manifest names is a plain name inside the directory: a manifest cannot make fxquant read,
    replace or delete a file anywhere else."""
    if not isinstance(files, dict):
        raise ArtifactError(f"{path}: \"files\" must map roles to file entries")
    for role, entry in files.items():
        name = entry.get("name") if isinstance(entry, dict) else None
        if (not isinstance(name, str) or not _FILE_NAME.match(name) or name == MANIFEST_NAME
                or not isinstance(entry.get("sha256"), str)):
            raise ArtifactError(f"{path}: the {role} file entry {entry!r} is not a file name inside the directory "
                                "with its SHA-256; fxquant reads only files it wrote next to the manifest")


def regular_file(path: Path, what: str, *, limit: int | None = None, size: int | None = None) -> None:
    """Refuse anything but a regular file (a symbolic link, a device, a FIFO) and a file of the wrong size."""
    try:
        info = path.lstat()
    except OSError:
        raise ArtifactError(f"{path} is missing; the manifest lists it as {what}") from None
    if stat.S_ISLNK(info.st_mode):
        raise ArtifactError(f"{path} ({what}) is a symbolic link; fxquant reads only regular files inside the "
                            "artifact directory")
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(f"{path} ({what}) is not a regular file")
    if limit is not None and info.st_size > limit:
        raise ArtifactError(f"{path} ({what}) is {info.st_size} bytes, more than the {limit} fxquant reads")
    if size is not None and info.st_size != size:
        raise ArtifactError(f"{path} does not match the SHA-256 in the manifest ({info.st_size} bytes, {size} "
                            "recorded): the file was modified, truncated or replaced; re-run the stage that made it")


def _check_version(path: Path, data: dict[str, Any]) -> None:
    version = data.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: missing or invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"{path} was written by fxquant {data.get('fxquant_version', '?')} in artifact format "
                            f"{version}; this fxquant ({_fxquant_version()}) reads format {FORMAT_VERSION} and "
                            "older: upgrade fxquant")


def verify_file(directory: Path, manifest: Manifest, role: str) -> Path:
    """The path of the file playing ``role``, after checking it exists and its SHA-256 matches the manifest."""
    entry = manifest.files.get(role)
    if entry is None:
        raise ArtifactError(f"{directory}: the artifact has no {role} file (stage {manifest.stage})")
    path = directory / entry["name"]
    declared = entry.get("bytes")
    regular_file(path, f"the {role} file", size=declared if isinstance(declared, int) else None)
    if sha256_file(path) != entry["sha256"]:
        raise ArtifactError(f"{path} does not match the SHA-256 in the manifest: the file was modified, truncated "
                            "or replaced; re-run the stage that produced it")
    return path

"""The JSON manifest of an artifact directory: what was made, from what, by which versions, and file hashes.

The manifest is the single commit point of an artifact: tensor files are content-addressed (their name carries
their hash), so writing a new stage never overwrites a file the current manifest names, and renaming the new
manifest into place switches atomically from the old artifact to the new one.

The manifest carries a checksum of its own content. It protects against accidental edits and truncation (a
hand-edited config would silently disagree with the saved statistics), not against an attacker, who could
recompute it; safety against malicious files comes from never unpickling anything but tensors.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from fxquant.config import QuantConfig
from fxquant.errors import ArtifactError
from fxquant.serialization import atomic_write, sha256_bytes, sha256_file
from fxquant.state import InputSpec

FORMAT = "fxquant-artifact"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STAGES = ("prepared", "calibrated", "converted")


def _fxquant_version() -> str:
    from fxquant import __version__  # lazy: fxquant/__init__ imports this package

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
    calibration_samples: int = 0
    files: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> {"name": file, "sha256": digest}
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
        return tuple(InputSpec(tuple(s["shape"]), s["dtype"]) for s in self.example_inputs)

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
    if not path.is_file():
        what = "is not a directory" if not Path(directory).is_dir() else f"has no {MANIFEST_NAME}"
        raise ArtifactError(f"{directory} {what}; give a directory written by fxquant.save or fxquant prepare")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); the file is truncated or corrupt") from None
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
    return manifest


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
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; the manifest lists it as the {role} file")
    if sha256_file(path) != entry["sha256"]:
        raise ArtifactError(f"{path} does not match the SHA-256 in the manifest: the file was modified, truncated "
                            "or replaced; re-run the stage that produced it")
    return path

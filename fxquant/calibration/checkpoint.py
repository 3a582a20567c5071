"""Checkpoint and resume a calibration run: observer statistics as plain tensors, written atomically.

A checkpoint is one ``torch.save`` file holding a dict of plain data: each observer's ``state_dict()`` (tensors),
how far the data stream was consumed, the summary counts so far, and a fingerprint of the observer layout (names,
classes, options, buffer shapes and dtypes). Loading uses ``torch.load(weights_only=True)``, so a checkpoint never
executes code. Writes go to a temporary file in the same directory, then ``os.replace``: an interruption (Ctrl-C,
a killed job) leaves either the previous checkpoint or the new one, never half a file.

Observer statistics are a pure function of the batches seen, so restoring them and skipping the batches already
consumed continues the run exactly: the final statistics are identical to an uninterrupted run's, as long as the
data yields the same batches in the same order (no unseeded shuffling).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxquant.errors import ArtifactError
from fxquant.observers import Observer
from fxquant.serialization import check_archive

log = logging.getLogger(__name__)

FORMAT = "fxquant-calibration-checkpoint"
VERSION = 1
_NOT_OPTIONS = frozenset({"training", "enabled"})  # run-time switches, not part of what the statistics mean


@dataclass
class Progress:
    """How far a run got: stream items consumed (used or skipped), the summary counts, and the samples recorded in
    the model's state before the run started (so a resumed run reports the same total)."""

    position: int = 0
    batches: int = 0
    samples: int = 0
    skipped: list[int] = field(default_factory=list)
    base_samples: int = 0


def fingerprint(observers: Mapping[str, Observer]) -> str:
    """A hash of everything that must match for saved statistics to mean the same thing in ``observers``."""
    layout = []
    for name, obs in sorted(observers.items()):
        options = {k: v for k, v in vars(obs).items() if not k.startswith("_") and k not in _NOT_OPTIONS
                   and isinstance(v, (bool, int, float, str))}
        buffers = {k: [list(v.shape), str(v.dtype)] for k, v in obs.state_dict().items()}
        layout.append([name, f"{type(obs).__module__}.{type(obs).__qualname__}", options, buffers])
    return hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()


def save_checkpoint(path: str | os.PathLike[str], observers: Mapping[str, Observer], progress: Progress) -> None:
    """Write the observers' statistics and ``progress`` to ``path`` atomically (temporary file + ``os.replace``)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "version": VERSION, "fingerprint": fingerprint(observers),
        "position": progress.position, "batches": progress.batches, "samples": progress.samples,
        "skipped": list(progress.skipped), "base_samples": progress.base_samples,
        "observers": {name: {k: v.detach().clone() for k, v in obs.state_dict().items()}
                      for name, obs in observers.items()},
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> dict[str, Any]:
    if path.is_symlink():  # it lives in RUN_DIR, which may come from someone else: read only what was written there
        raise ArtifactError(f"calibration checkpoint {path} is a symbolic link; delete it or pass resume=False")
    check_archive(path, zip_only=True)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ArtifactError(f"calibration checkpoint {path} is corrupt or truncated ({reason}); delete it or pass "
                            "resume=False to start calibration over") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not an fxquant calibration checkpoint; pass another checkpoint path")
    if payload.get("version") != VERSION:
        raise ArtifactError(f"calibration checkpoint {path} has format version {payload.get('version')!r}; this "
                            f"fxquant reads version {VERSION}. Pass resume=False to start over")
    return payload


def load_checkpoint(path: str | os.PathLike[str], observers: Mapping[str, Observer]) -> Progress:
    """Restore the observers' statistics from ``path`` and return the saved progress.

    Raises ``ArtifactError`` when the file is corrupt, truncated, of another format, or was written for another
    observer layout (another model, config or observer options).
    """
    payload = _read(Path(path))
    if payload.get("fingerprint") != fingerprint(observers):
        raise ArtifactError(
            f"calibration checkpoint {path} was written for a different observer layout (another model, config or "
            f"observer options: {len(payload.get('observers', {}))} observers saved, {len(observers)} in this "
            "model); it cannot resume this run. Use the same prepare() inputs, or pass resume=False to start over")
    try:
        for name, obs in observers.items():
            obs.load_state_dict(payload["observers"][name])
        return Progress(int(payload["position"]), int(payload["batches"]), int(payload["samples"]),
                        [int(i) for i in payload["skipped"]], int(payload["base_samples"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ArtifactError(f"calibration checkpoint {path} is damaged ({type(exc).__name__}: {exc}); delete it or "
                            "pass resume=False") from None

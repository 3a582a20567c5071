"""The per-user trust record: the run directories this user prepared here, and what each may make fxquant import.

A run directory is data. Its manifest names the model factory, but anyone can write a manifest (its checksum only
catches accidents), so the command line imports a factory named by a run directory only when the user vouched for
it (:func:`fxquant.cli.source.authorize`). ``fxquant prepare`` vouches: it records the run directory's resolved path
with the specs it may import and the weights file it was made from, in a file outside every run directory:
``$FXQUANT_TRUST_FILE``, else ``$XDG_STATE_HOME/fxquant/trusted-runs.json`` (``~/.local/state/fxquant/...``). The
record is believed only while this user owns it and nobody else can write to it. See docs/cli.md, "Trust".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fxquant.serialization import atomic_write

TRUST_FILE_ENV = "FXQUANT_TRUST_FILE"
MAX_TRUST_BYTES = 16 << 20
_FORMAT = "fxquant-trusted-runs"
_log = logging.getLogger("fxquant")


@dataclass(frozen=True)
class TrustedRun:
    """What one run directory may make fxquant import and open, as this user recorded it."""

    model: str  # PKG.MODULE:FACTORY
    example_inputs: str  # the spec given to prepare (a factory is only called again for runs that do not store them)
    weights: str | None = None  # absolute path of the weights file on this machine
    weights_sha256: str | None = None


def trust_file() -> Path:
    """Where this user's trust record lives (the file need not exist yet)."""
    if os.environ.get(TRUST_FILE_ENV):
        return Path(os.environ[TRUST_FILE_ENV]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path("~", ".local", "state"))
    return Path(state).expanduser() / "fxquant" / "trusted-runs.json"


def run_key(directory: Path) -> str:
    """A run directory's identity in the record: its resolved path (a moved or copied run is another run)."""
    return str(Path(directory).resolve())


def lookup(directory: Path) -> TrustedRun | None:
    """The record for ``directory``, or None when this user did not vouch for it here."""
    entry = (_read(trust_file()) or {}).get(run_key(directory))
    if not isinstance(entry, dict):
        return None
    model, example, weights, digest = (entry.get(f.name) for f in dataclasses.fields(TrustedRun))
    if not isinstance(model, str) or not isinstance(example, str):
        return None
    if not all(v is None or isinstance(v, str) for v in (weights, digest)):
        return None
    return TrustedRun(model, example, weights, digest)


def remember(directory: Path, run: TrustedRun) -> None:
    """Record ``run`` for ``directory``. Failing to write is a warning: the run itself is complete, and later stages
    accept ``--model`` instead."""
    path = trust_file()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _locked(path):
            runs = _read(path)
            if runs is None:
                return  # an unsafe or unreadable record is left to its owner (the warning says which and why)
            entry = {**dataclasses.asdict(run), "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            old = runs.get(run_key(directory))
            if isinstance(old, dict) and {k: v for k, v in old.items() if k != "at"} == dataclasses.asdict(run):
                return
            runs[run_key(directory)] = entry
            body = {"format": _FORMAT, "version": 1, "runs": runs}
            atomic_write(path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
    except OSError as exc:
        _log.warning("warning: could not record %s as yours in the trust record %s (%s); later stages will need "
                     "--model", directory, path, exc)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (POSIX), so concurrent stages do not lose each other's runs."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still keeps the file whole
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> dict[str, Any] | None:
    """The record's runs ({} when there is no record); None, with a warning why, for an unsafe or unreadable one."""
    try:
        info = path.stat()
    except OSError:
        return {}
    problem = _unsafe(info)
    if problem is None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            data, problem = None, f"is not readable JSON ({type(exc).__name__})"
        if problem is None and not (isinstance(data, dict) and data.get("format") == _FORMAT
                                    and isinstance(data.get("runs"), dict)):
            problem = f"is not an fxquant trust record (no \"format\": \"{_FORMAT}\")"
    if problem is not None:
        _log.warning("warning: ignoring the trust record %s: it %s", path, problem)
        return None
    return dict(data["runs"])


def _unsafe(info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_size > MAX_TRUST_BYTES:
        return f"is larger than {MAX_TRUST_BYTES} bytes"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return "belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by other users (chmod go-w it)"
    return None

"""Helpers shared by the command-line tests: run the CLI (subprocess or in-process) and snapshot RUN_DIR."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real ``fxquant`` command in a subprocess, with cli_helpers importable and no hub access."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "fxquant", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def main_cli(*args: str) -> Outcome:
    """``fxquant.cli.main`` in this process (no torch start-up cost); same exit codes and output as the command."""
    from fxquant.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["--quiet", *args])
        except SystemExit as exc:  # argparse's usage errors exit 2, as the command does
            code = exc.code if isinstance(exc.code, int) else 1
    return Outcome(code, out.getvalue(), err.getvalue())


def error_line(outcome: Outcome | subprocess.CompletedProcess[str], command: str) -> str:
    """The one ``fxquant COMMAND: error: ...`` line on stderr (asserts there is exactly one, and no traceback)."""
    lines = [line for line in outcome.stderr.splitlines() if line.startswith(f"fxquant {command}: error:")]
    assert len(lines) == 1, outcome.stderr
    assert "Traceback" not in outcome.stderr, outcome.stderr
    return lines[0]


def trusted_copy(run: Path, copy: Path) -> Path:
    """Copy a run directory and vouch for the copy as ``prepare`` would have (a copy is another run: untrusted)."""
    import shutil

    from fxquant.cli import trust

    shutil.copytree(run, copy)
    record = trust.lookup(run)
    assert record is not None, f"{run} is not in the trust record"
    trust.remember(copy, record)
    return copy


def snapshot(directory: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``directory``: 'nothing changed' means equal snapshots."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}

"""An interrupted ``fxquant calibrate`` leaves RUN_DIR's stages as they were, and ``--resume`` finishes the job with
exactly the statistics of an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import INTERRUPT_AFTER
from cli_testing import main_cli, snapshot

MODEL = ("--model", "fxquant.models:digits_cnn", "--example-inputs", "1x1x8x8")


def _prepare(tmp_path: Path, name: str) -> Path:
    config = tmp_path / "fxquant.json"
    config.write_text(json.dumps({"activation": "histogram", "observer_options": {"bins": 128}}))
    run = tmp_path / name
    assert main_cli("prepare", *MODEL, "--config", str(config), "-o", str(run)).returncode == 0
    return run


def test_interrupted_calibration_resumes_to_the_same_statistics(tmp_path: Path) -> None:
    reference = _prepare(tmp_path, "reference")
    assert main_cli("calibrate", str(reference), "--data", "cli_helpers:calib_batches").returncode == 0

    run = _prepare(tmp_path, "run")
    before = snapshot(run)
    interrupted = main_cli("calibrate", str(run), "--data", "cli_helpers:interrupted_batches",
                           "--checkpoint-every", "1")
    assert interrupted.returncode == 130 and "interrupted" in interrupted.stderr
    after = snapshot(run)
    assert {k: v for k, v in after.items() if not k.startswith("checkpoints/")} == before  # stages untouched
    assert "checkpoints/calibration.pt" in after

    resumed = main_cli("--json", "calibrate", str(run), "--data", "cli_helpers:calib_batches", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["resumed_batches"] == INTERRUPT_AFTER and summary["batches"] == 6
    assert not (run / "checkpoints").exists()
    # content-addressed file names: equal names mean byte-identical statistics
    assert sorted(p.name for p in run.glob("observers-*.pt")) == sorted(
        p.name for p in reference.glob("observers-*.pt"))

"""``fxquant calibrate RUN_DIR --distributed``: two local gloo processes (spawned, or started by torchrun) against one.

Statistics are compared through what RUN_DIR holds: the run is rebuilt from its files as ``fxquant convert`` would.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from calib_helpers import MIXED_OBSERVERS
from test_calibration_distributed import free_port

from fxquant.artifacts.manifest import read_manifest
from fxquant.calibration import observers_of
from fxquant.cli import main
from fxquant.cli.rundir import rebuild_run

HERE = Path(__file__).parent
TIMEOUT_S = 180
DATA = "calib_helpers:batches"


def fxquant_cli(*args: str, launcher: tuple[str, ...] = ("-m", "fxquant")) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *launcher, *args], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared RUN_DIR (TinyNet, histogram observers with two minmax ones); copy it before calibrating."""
    root = tmp_path_factory.mktemp("runs")
    config = root / "config.json"
    config.write_text(json.dumps({"activation": "histogram",
                                  "overrides": {k: {"activation": v} for k, v in MIXED_OBSERVERS.items()}}))
    result = fxquant_cli("--quiet", "prepare", "--model", "calib_helpers:tiny_net", "--example-inputs", "4x3x8x8",
                         "--config", str(config), "-o", str(root / "prepared"))
    assert result.returncode == 0, result.stderr
    return root / "prepared"


def copy_run(prepared_run: Path, tmp_path: Path, name: str) -> Path:
    """A copy of the run, vouched for like the original (a copied run is otherwise not trusted: docs/cli.md)."""
    from fxquant.cli import trust

    copy = Path(shutil.copytree(prepared_run, tmp_path / name))
    record = trust.lookup(prepared_run)
    assert record is not None
    trust.remember(copy, record)
    return copy


def calibrated_observers(run: Path) -> dict[str, torch.nn.Module]:
    manifest = read_manifest(run)
    assert manifest.stage == "calibrated"
    return observers_of(rebuild_run(run, manifest).model)


def assert_same_as_single_process(distributed: Path, single: Path) -> None:
    """Min/max statistics exactly equal; every observer's qparams within one quantization step."""
    ours, reference = calibrated_observers(distributed), calibrated_observers(single)
    assert ours.keys() == reference.keys()
    for name, obs in ours.items():
        expected = reference[name]
        for stat in ("min_val", "max_val", "num_updates", "num_elements"):
            assert torch.equal(getattr(obs, stat), getattr(expected, stat)), f"{name}.{stat}"
        mine, theirs = obs.qparams(), expected.qparams()
        steps = float((mine.scale - theirs.scale).abs() / theirs.scale)
        assert steps <= 1.0 / 255 and abs(int(mine.zero_point) - int(theirs.zero_point)) <= 1, (name, mine, theirs)


def test_two_spawned_processes_write_the_single_process_statistics(prepared_run: Path, tmp_path: Path) -> None:
    single, distributed = copy_run(prepared_run, tmp_path, "single"), copy_run(prepared_run, tmp_path, "dist")
    assert fxquant_cli("--quiet", "calibrate", str(single), "--data", DATA).returncode == 0
    result = fxquant_cli("--json", "--quiet", "calibrate", str(distributed), "--data", DATA, "--distributed", "2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # one JSON document: only rank 0 reports
    assert report["world_size"] == 2 and report["batches"] == 12 and report["samples"] == 48
    assert_same_as_single_process(distributed, single)
    assert read_manifest(distributed).history[-1]["world_size"] == 2
    assert not (distributed / "checkpoints").exists()  # every rank removed its checkpoint after the commit


@pytest.mark.slow
def test_torchrun_launch_with_distributed_flag(prepared_run: Path, tmp_path: Path) -> None:
    single, distributed = copy_run(prepared_run, tmp_path, "single"), copy_run(prepared_run, tmp_path, "dist")
    assert fxquant_cli("--quiet", "calibrate", str(single), "--data", DATA).returncode == 0
    torchrun = ("-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}", "-m", "fxquant")
    result = fxquant_cli("--quiet", "calibrate", str(distributed), "--data", DATA, "--distributed",
                         launcher=torchrun)
    assert result.returncode == 0, result.stderr
    assert_same_as_single_process(distributed, single)


def test_a_failing_rank_stops_the_others_and_leaves_the_run(prepared_run: Path, tmp_path: Path) -> None:
    run = copy_run(prepared_run, tmp_path, "dist")
    before = (run / "manifest.json").read_text()
    result = fxquant_cli("calibrate", str(run), "--data", "calib_helpers:odd_batches_wrong", "--distributed", "2",
                         "--dist-timeout", "120")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("fxquant calibrate: error:")]
    assert len(errors) == 1 and "rank 1" in errors[0] and "does not fit the model" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert (run / "manifest.json").read_text() == before


def run_in_process(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["--quiet", *args])
    return code, err.getvalue()


@pytest.mark.parametrize(("env", "flag", "expected"), [
    ({}, ["--distributed"], "needs a torchrun launch"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, [], "add --distributed"),
    ({"RANK": "0", "WORLD_SIZE": "3"}, ["--distributed", "2"], "started 3 processes"),
])
def test_inconsistent_distributed_requests_are_one_line_errors(
        prepared_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], flag: list[str],
        expected: str) -> None:
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run = copy_run(prepared_run, tmp_path, "run")
    code, stderr = run_in_process("calibrate", str(run), "--data", DATA, *flag)
    assert code == 2 and stderr.count("\n") == 1 and expected in stderr, stderr

"""One test per bad input: exit status 2, exactly one ``fxquant CMD: error: ...`` line, and RUN_DIR untouched.

Most cases call ``fxquant.cli.main`` in this process (the same code path as the command, without ~2 s of torch
start-up per case); ``test_real_process_reports_one_line`` checks the console script itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_testing import error_line, main_cli, run_cli, snapshot, trusted_copy

from fxquant.artifacts.manifest import checksum

MODEL = ("--model", "fxquant.models:digits_cnn", "--example-inputs", "1x1x8x8")


@pytest.fixture(scope="module")
def converted_run(tmp_path_factory: pytest.TempPathFactory, digits_weights: Path) -> Path:
    run = tmp_path_factory.mktemp("runs") / "converted"
    assert main_cli("prepare", *MODEL, "--weights", str(digits_weights), "-o", str(run)).returncode == 0
    assert main_cli("calibrate", str(run), "--data", "cli_helpers:calib_batches").returncode == 0
    assert main_cli("convert", str(run)).returncode == 0
    return run


@pytest.fixture
def run(converted_run: Path, tmp_path: Path) -> Path:
    return trusted_copy(converted_run, tmp_path / "run")


def _edit_manifest(run: Path, change: Callable[[dict], None], *, resign: bool) -> None:
    """Change the manifest; ``resign`` recomputes its checksum, as a deliberate tamperer would."""
    path = run / "manifest.json"
    data = json.loads(path.read_text())
    data.pop("checksum")
    change(data)
    data["checksum"] = checksum(data) if resign else "0" * 64
    path.write_text(json.dumps(data))


def _fails_cleanly(run: Path, command: str, *args: str) -> str:
    """Run ``command``; assert exit 2, one error line, RUN_DIR unchanged; return the error line."""
    before = snapshot(run)
    outcome = main_cli(command, *args)
    assert outcome.returncode == 2, outcome.stderr
    line = error_line(outcome, command)
    assert snapshot(run) == before, "a failing command changed RUN_DIR"
    return line


def test_missing_module(tmp_path: Path) -> None:
    outcome = main_cli("prepare", "--model", "no_such_pkg.models:net", "--example-inputs", "1x4",
                       "-o", str(tmp_path / "run"))
    assert outcome.returncode == 2
    assert "cannot import module 'no_such_pkg.models'" in error_line(outcome, "prepare")
    assert not (tmp_path / "run").exists()


def test_factory_that_raises(tmp_path: Path) -> None:
    outcome = main_cli("prepare", "--model", "cli_helpers:failing_factory", "--example-inputs", "1x4",
                       "-o", str(tmp_path / "run"))
    assert outcome.returncode == 2
    assert "raised RuntimeError: checkpoint server unreachable" in error_line(outcome, "prepare")
    assert not (tmp_path / "run").exists()


def test_malformed_shape_spec(run: Path) -> None:
    line = _fails_cleanly(run, "prepare", "--model", "fxquant.models:digits_cnn", "--example-inputs", "1by8",
                          "-o", str(run), "--overwrite")
    assert "'1by8' is not a shape like 1x3x224x224" in line


def test_config_typo_names_the_nearest_key(run: Path, tmp_path: Path) -> None:
    config = tmp_path / "fxquant.yaml"
    config.write_text("backend: fbgemm\nactivaton: histogram\n")
    line = _fails_cleanly(run, "prepare", *MODEL, "--config", str(config), "-o", str(run), "--overwrite")
    assert "unknown key 'activaton'" in line and "Did you mean 'activation'?" in line and "Valid keys:" in line


def test_missing_data_file(run: Path) -> None:
    line = _fails_cleanly(run, "calibrate", str(run), "--data", str(run / "missing.npy"))
    assert "missing.npy': no such file" in line


def test_hub_dataset_without_network_says_why_and_how_to_fix(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _fails_cleanly(run, "calibrate", str(run), "--data", "someuser/digits")
    assert "offline mode is set" in line and "save_to_disk" in line


def test_tampered_manifest(run: Path) -> None:
    _edit_manifest(run, lambda m: m["config"].update(activation="histogram"), resign=False)
    assert "was modified after fxquant wrote it" in _fails_cleanly(run, "report", str(run), "--data", "x.npy")


def test_tampered_tensor_file(run: Path) -> None:
    observers = next(run.glob("observers-*.pt"))
    observers.write_bytes(observers.read_bytes()[:-10])  # truncated
    assert "does not match the SHA-256 in the manifest" in _fails_cleanly(run, "convert", str(run))


class _Payload:
    """Unpickling this would create a directory: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_pickled_payload_in_a_tensor_file_is_refused(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    observers = next(run.glob("observers-*.pt"))
    torch.save({"observer_0.min_val": _Payload(marker)}, observers)
    data = observers.read_bytes()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    _edit_manifest(run, lambda m: m["files"]["observers"].update(entry), resign=True)
    line = _fails_cleanly(run, "convert", str(run))
    assert "refused to load" in line and not marker.exists()


def test_run_dir_from_a_newer_fxquant(run: Path) -> None:
    _edit_manifest(run, lambda m: m.update(format_version=99, fxquant_version="9.0.0"), resign=True)
    line = _fails_cleanly(run, "convert", str(run))
    assert "fxquant 9.0.0 in artifact format 99" in line and "upgrade fxquant" in line


def test_model_whose_graph_changed(run: Path, digits_weights: Path) -> None:
    """The user names the model (a changed one) and the manifest agrees: the graph check refuses it."""
    _edit_manifest(run, lambda m: m["source"].update(model="cli_helpers:changed_digits_cnn"), resign=True)
    line = _fails_cleanly(run, "convert", str(run), "--model", "cli_helpers:changed_digits_cnn",
                          "--weights", str(digits_weights))
    assert "the model's graph no longer matches the artifact" in line and "softmax" in line


def test_weights_changed_since_prepare(tmp_path: Path, digits_weights: Path) -> None:
    weights, run = tmp_path / "weights.pt", tmp_path / "run"
    shutil.copy(digits_weights, weights)
    assert main_cli("prepare", *MODEL, "--weights", str(weights), "-o", str(run)).returncode == 0
    torch.save({k: v + 1 for k, v in torch.load(weights, weights_only=True).items()}, weights)
    assert "changed since `fxquant prepare`" in _fails_cleanly(run, "calibrate", str(run), "--data",
                                                                 "cli_helpers:calib_batches")


def test_factory_that_builds_different_weights_each_time(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert main_cli("prepare", "--model", "cli_helpers:unseeded_digits_cnn", "--example-inputs", "1x1x8x8",
                    "-o", str(run)).returncode == 0
    line = _fails_cleanly(run, "calibrate", str(run), "--data", "cli_helpers:calib_batches")
    assert "now builds different weights than at `fxquant prepare`" in line


def test_stage_not_reached_yet(run: Path, digits_weights: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    assert main_cli("prepare", *MODEL, "-o", str(fresh)).returncode == 0
    assert "run `fxquant calibrate RUN_DIR" in _fails_cleanly(fresh, "convert", str(fresh))
    line = _fails_cleanly(run, "prepare", *MODEL, "-o", str(run))
    assert "already holds a run" in line


@pytest.mark.parametrize(("args", "message"), [
    (("--model", "no_such_pkg.mod:f", "--example-inputs", "1x4"), "cannot import module 'no_such_pkg.mod'"),
    (("--model", "fxquant.models:nope", "--example-inputs", "1x4"), "has no attribute 'nope'"),
    (("--model", "fxquant.models:mlp_net", "--example-inputs", "1by1024"), "'1by1024' is not a shape"),
    (("--model", "fxquant.models:mlp_net", "--example-inputs", "1x7"), "rejects the example inputs"),
    (("--model", "fxquant.models:mlp_net", "--example-inputs", "1x1024", "--config", "missing.yaml"),
     "does not exist"),
])
def test_graph_on_bad_input_exits_2_with_one_line(args: tuple[str, ...], message: str) -> None:
    outcome = main_cli("graph", *args)  # the real process's one line: test_real_process_reports_one_line
    assert outcome.returncode == 2 and message in error_line(outcome, "graph")


def test_real_process_reports_one_line(run: Path) -> None:
    before = snapshot(run)
    result = run_cli("calibrate", str(run), "--data", "no_such_pkg:data")
    assert result.returncode == 2
    assert "cannot import module 'no_such_pkg'" in error_line(result, "calibrate")
    assert snapshot(run) == before  # (--debug's traceback is checked by tests/test_cli.py)


def test_usage_errors_are_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    from fxquant.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--batches", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_a_bad_fxquant_isa_is_one_line_not_a_traceback_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C loops read FXQUANT_ISA while ``import fxquant`` runs; a bad value must still end as exit 2, one line."""
    monkeypatch.setenv("FXQUANT_ISA", "sse9")
    result = run_cli("graph", "--model", "fxquant.models:conv_bn_net", "--example-inputs", "1x3x32x32")
    assert result.returncode == 2, result.stderr
    assert "FXQUANT_ISA='sse9' is not one of avx2, avx512, vnni, amx" in error_line(result, "graph")

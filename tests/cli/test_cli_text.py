"""Language models on the command line: a Hugging Face model folder in, text cut into token windows, perplexity out.

The model is a 2-layer Llama with random weights and a byte-level BPE tokenizer trained here on Python docstrings,
both written with ``save_pretrained`` (nothing is downloaded). The perplexity the report prints is checked against
the same windows run through the float model loaded by transformers itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_testing import error_line, main_cli, snapshot

from fxquant.models.corpus import calibration_text, evaluation_text, perplexity, token_windows

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SEQ_LEN = 32
CONTEXT = 64


def _tokenizer() -> Any:
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    model.train_from_iterator([calibration_text()[:30000]], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``llama`` (model and tokenizer), ``no-tokenizer`` (the model alone), ``classifier`` (a BERT sequence
    classifier with the tokenizer: not a causal LM), and the text files ``calib.txt`` / ``eval.txt``."""
    root = tmp_path_factory.mktemp("hf")
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=CONTEXT)
    llama = transformers.LlamaForCausalLM(config).eval()
    for name, with_tokenizer in (("llama", True), ("no-tokenizer", False)):
        llama.save_pretrained(root / name)
        if with_tokenizer:
            tokenizer.save_pretrained(root / name)
    bert = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=CONTEXT)
    transformers.BertForSequenceClassification(bert).eval().save_pretrained(root / "classifier")
    tokenizer.save_pretrained(root / "classifier")
    (root / "calib.txt").write_text(calibration_text()[:6000], encoding="utf-8")
    (root / "eval.txt").write_text(evaluation_text()[:4000], encoding="utf-8")
    return {"root": root, **{name: root / name for name in ("llama", "no-tokenizer", "classifier")},
            "calib": root / "calib.txt", "eval": root / "eval.txt"}


def _ok(*args: str) -> dict[str, Any]:
    outcome = main_cli("--json", *args)
    assert outcome.returncode == 0, outcome.stderr
    return json.loads(outcome.stdout)


@pytest.fixture(scope="module")
def converted(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the Llama folder, prepared (path given as is), calibrated on text, converted."""
    run = tmp_path_factory.mktemp("runs") / "llama"
    _ok("prepare", "--model", str(folders["llama"]), "-o", str(run))
    _ok("calibrate", str(run), "--data", str(folders["calib"]), "--seq-len", str(SEQ_LEN), "--batch-size", "4")
    _ok("convert", str(run))
    return run


def test_a_model_folder_is_recorded_as_transformers_spec_with_token_example_inputs(folders: dict[str, Path],
                                                                                  converted: Path) -> None:
    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["source"]["model"] == f"transformers:{folders['llama'].resolve()}"
    assert manifest["source"]["example_inputs"] == "tokens:1x32"
    history = {entry["stage"]: entry for entry in manifest["history"]}
    windows = len(token_windows(_tokenizer_of(folders), calibration_text()[:6000], SEQ_LEN))
    assert history["calibrated"]["samples"] == windows  # every whole window of the file, once


def _tokenizer_of(folders: dict[str, Path]) -> Any:
    return transformers.AutoTokenizer.from_pretrained(folders["llama"])


def test_report_perplexity_is_the_float_models_own_on_the_same_windows(folders: dict[str, Path],
                                                                      converted: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    _ok("report", str(converted), "--data", str(folders["eval"]), "--seq-len", str(SEQ_LEN), "--metric",
        "perplexity", "--batch-size", "3", "--latency-budget", "0.5", "--format", "json", "-o", str(out))
    accuracy = json.loads(out.read_text())["accuracy"]
    model = transformers.LlamaForCausalLM.from_pretrained(folders["llama"]).eval()
    windows = token_windows(_tokenizer_of(folders), evaluation_text()[:4000], SEQ_LEN)
    expected = perplexity(model, windows)
    assert accuracy["metric"] == "perplexity" and accuracy["higher_is_better"] is False
    assert math.isclose(accuracy["float"], expected, rel_tol=1e-5), (accuracy["float"], expected)
    assert accuracy["samples"] == len(windows)
    # random weights give a near-uniform model: INT8 moves its perplexity by well under a percent
    assert abs(accuracy["quantized"] / accuracy["float"] - 1) < 0.01, accuracy


def test_regress_gates_a_relative_perplexity_increase(folders: dict[str, Path], converted: Path,
                                                      tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    _ok("report", str(converted), "--data", str(folders["eval"]), "--seq-len", str(SEQ_LEN), "--metric",
        "perplexity", "--latency-budget", "0.3", "--format", "json", "-o", str(base))
    worse = json.loads(base.read_text())
    worse["accuracy"]["quantized"] *= 1.02
    new = tmp_path / "new.json"
    new.write_text(json.dumps(worse))
    failing = main_cli("regress", str(new), "--baseline", str(base), "--max-relative-drop", "1")
    assert failing.returncode == 1 and "perplexity (int8, relative)" in failing.stdout
    assert "+2.00%" in failing.stdout
    assert main_cli("regress", str(new), "--baseline", str(base), "--max-relative-drop", "3").returncode == 0


def test_a_datasets_text_column_gives_the_windows_of_its_rows_joined(folders: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [part for part in calibration_text()[:6000].split("\n\n") if part.strip()]
    datasets.Dataset.from_dict({"body": rows}).save_to_disk(str(tmp_path / "ds"))
    run = tmp_path / "run"
    _ok("prepare", "--model", f"transformers:{folders['llama']}", "-o", str(run))
    result = _ok("calibrate", str(run), "--data", str(tmp_path / "ds"), "--columns", "body", "--seq-len",
                 str(SEQ_LEN), "--batch-size", "8")
    joined = "\n\n".join(rows)
    assert result["samples"] == len(token_windows(_tokenizer_of(folders), joined, SEQ_LEN))
    missing = main_cli("calibrate", str(run), "--data", str(tmp_path / "ds"), "--seq-len", str(SEQ_LEN))
    assert missing.returncode == 2 and "no text column 'text'" in error_line(missing, "calibrate")


@pytest.fixture
def prepared_run(folders: dict[str, Path], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    _ok("prepare", "--model", str(folders["llama"]), "-o", str(run))
    return run


def _text_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.txt"
    content = {"empty": b"  \n\n", "binary": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
               "latin1": "café au lait".encode("latin1"), "short": b"Too short."}[kind]
    path.write_bytes(content)
    return path


@pytest.mark.parametrize(("kind", "message"), [
    ("empty", "is empty"), ("binary", "is a binary file"), ("latin1", "is not UTF-8 text (byte 0xe9 at offset 3)"),
    ("short", "fewer than one window of --seq-len 32"),
])
def test_bad_text_is_one_clear_error_and_leaves_the_run_unchanged(prepared_run: Path, tmp_path: Path, kind: str,
                                                                 message: str) -> None:
    before = snapshot(prepared_run)
    outcome = main_cli("calibrate", str(prepared_run), "--data", str(_text_file(tmp_path, kind)), "--seq-len", "32")
    assert outcome.returncode == 2
    assert message in error_line(outcome, "calibrate")
    assert snapshot(prepared_run) == before


def test_a_window_longer_than_the_context_is_refused(prepared_run: Path, folders: dict[str, Path]) -> None:
    before = snapshot(prepared_run)
    outcome = main_cli("calibrate", str(prepared_run), "--data", str(folders["calib"]), "--seq-len",
                       str(CONTEXT + 1))
    assert outcome.returncode == 2
    assert f"longer than the model's context of {CONTEXT} tokens" in error_line(outcome, "calibrate")
    assert snapshot(prepared_run) == before


def test_text_without_seq_len_and_tensors_with_it_are_refused(prepared_run: Path, folders: dict[str, Path],
                                                              tmp_path: Path) -> None:
    outcome = main_cli("calibrate", str(prepared_run), "--data", str(folders["calib"]))
    assert outcome.returncode == 2 and "pass --seq-len N" in error_line(outcome, "calibrate")
    torch.save(torch.zeros(2, 8, dtype=torch.int64), tmp_path / "ids.pt")
    outcome = main_cli("calibrate", str(prepared_run), "--data", str(tmp_path / "ids.pt"), "--seq-len", "8")
    assert outcome.returncode == 2 and "drop --seq-len" in error_line(outcome, "calibrate")


def test_a_model_folder_without_a_tokenizer_names_the_fix(folders: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ok("prepare", "--model", str(folders["no-tokenizer"]), "-o", str(run))
    before = snapshot(run)
    outcome = main_cli("calibrate", str(run), "--data", str(folders["calib"]), "--seq-len", str(SEQ_LEN))
    assert outcome.returncode == 2
    line = error_line(outcome, "calibrate")
    assert "tokenizer" in line and "--tokenizer FOLDER" in line
    assert snapshot(run) == before
    # the fix the message names works
    _ok("calibrate", str(run), "--data", str(folders["calib"]), "--seq-len", str(SEQ_LEN), "--tokenizer",
        str(folders["llama"]), "--batches", "2")


def test_perplexity_of_a_model_that_is_not_a_causal_lm_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ok("prepare", "--model", str(folders["classifier"]), "-o", str(run))
    _ok("calibrate", str(run), "--data", str(folders["calib"]), "--seq-len", str(SEQ_LEN), "--batches", "2")
    _ok("convert", str(run))
    before = snapshot(run)
    outcome = main_cli("report", str(run), "--data", str(folders["eval"]), "--seq-len", str(SEQ_LEN), "--metric",
                       "perplexity")
    assert outcome.returncode == 2
    assert "perplexity needs a causal LM" in error_line(outcome, "report")
    assert snapshot(run) == before


def test_a_folder_without_config_json_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    outcome = main_cli("prepare", "--model", str(tmp_path / "empty"), "-o", str(tmp_path / "run"))
    assert outcome.returncode == 2 and "folder without config.json" in error_line(outcome, "prepare")
    assert not (tmp_path / "run").exists()


def test_a_copied_run_names_its_model_folder_and_takes_it_named_again(converted: Path, folders: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(converted, copy)  # another directory: not vouched for by this user's trust record
    refused = main_cli("graph", str(copy))
    assert refused.returncode == 2
    assert f"--model transformers:{folders['llama'].resolve()}" in error_line(refused, "graph")
    assert main_cli("graph", str(copy), "--model", str(folders["llama"])).returncode == 0  # the folder's path


def test_a_hub_id_that_is_not_in_the_cache_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    outcome = main_cli("prepare", "--model", "transformers:nobody/no-such-model", "-o", str(tmp_path / "run"))
    assert outcome.returncode == 2
    assert "no Hugging Face model of that id in the local cache" in error_line(outcome, "prepare")
    assert not (tmp_path / "run").exists()

"""The regression gate: verdicts per limit, exit codes 0/1/2, and assert_no_regression for pytest suites."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from report_helpers import API_EXAMPLE, digits_report

import fxquant
from fxquant.errors import ArtifactError
from fxquant.report.regress import compare, main
from fxquant.report.schema import Report


def _report(**changes: Any) -> dict[str, Any]:
    """The API example with some figures changed: quantized top1, latency medians, int8 bytes, output SQNR."""
    data = copy.deepcopy(API_EXAMPLE)
    data["accuracy"]["quantized"] = changes.get("top1", 0.978)
    data["latency_ms"]["float"]["median"] = changes.get("float_ms", 2.0)
    data["latency_ms"]["quantized"]["median"] = changes.get("int8_ms", 1.0)
    data["size_bytes"]["quantized"] = changes.get("bytes", 1000)
    data["fidelity"] = {"sqnr_db": changes.get("sqnr", 30.0), "cosine_similarity": 0.999, "max_abs_error": 0.1}
    return data


def _write(tmp_path: Path, name: str, data: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_each_limit_has_a_row_with_its_units() -> None:
    result = compare(_report(top1=0.970, float_ms=3.2, int8_ms=2.0, bytes=1100, sqnr=25.0), _report(),
                     max_accuracy_drop=0.5, max_latency_increase=30, max_size_increase=5, min_sqnr=20)
    rows = {row.metric: row for row in result.rows}
    assert rows["top1 (int8)"].delta == pytest.approx(-0.8) and rows["top1 (int8)"].passed is False  # 0.8 pts
    speed = rows["speed-up, headline (latency +%)"]
    assert (speed.baseline, speed.new) == (2.0, 1.6) and speed.delta == pytest.approx(25.0) and speed.passed
    assert rows["int8 size"].delta == pytest.approx(10.0) and rows["int8 size"].passed is False
    assert rows["output SQNR"].passed and rows["top1 (float)"].passed is None  # shown, not gated
    assert not result.passed
    table = result.to_table()
    assert "FAILED: 2 limit(s) crossed" in table and "drop <= 0.5 pts" in table and "-0.80 pts" in table


def test_latency_compares_speedups_unless_absolute_is_asked() -> None:
    # Both models twice as slow (a busier machine): the speed-up is unchanged, the milliseconds doubled.
    slower = _report(float_ms=4.0, int8_ms=2.0)
    assert compare(slower, _report(), max_latency_increase=10).passed
    absolute = compare(slower, _report(), max_latency_increase=10, absolute_latency=True)
    assert not absolute.passed and absolute.rows[2].delta == pytest.approx(100.0)


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    baseline = _write(tmp_path, "old.json", _report())
    good = _write(tmp_path, "good.json", _report(top1=0.976))
    bad = _write(tmp_path, "bad.json", _report(top1=0.960, sqnr=12.0))
    assert main([good, "--baseline", baseline, "--max-accuracy-drop", "0.5", "--min-sqnr", "20"]) == 0
    assert "passed" in capsys.readouterr().out
    assert main([bad, "--baseline", baseline, "--max-accuracy-drop", "0.5", "--min-sqnr", "20"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "baseline" in out.splitlines()[0]
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    assert main([str(corrupt), "--baseline", baseline]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    wrong_version = _write(tmp_path, "v2.json", {**_report(), "schema_version": 2})
    assert main([good, "--baseline", wrong_version]) == 2
    assert "schema_version 2" in capsys.readouterr().err
    assert main([good, "--baseline", str(tmp_path / "missing.json")]) == 2


def test_cli_runs_as_a_module(tmp_path: Path) -> None:
    baseline = _write(tmp_path, "old.json", _report())
    new = _write(tmp_path, "new.json", _report(bytes=2000))
    command = [sys.executable, "-m", "fxquant.report.regress", new, "--baseline", baseline, "--max-size-increase", "5"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1, run.stderr
    assert "int8 size" in run.stdout and "+100.00%" in run.stdout


def test_different_metrics_are_not_compared() -> None:
    other = _report()
    other["accuracy"]["metric"] = "top5"
    with pytest.raises(ArtifactError, match="different metrics"):
        compare(other, _report())


def test_assert_no_regression_takes_reports_dicts_and_paths(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    digits_report().to_json(path)
    result = fxquant.assert_no_regression(digits_report(), path, max_accuracy_drop=0.0, max_size_increase=0.0,
                                          min_sqnr=10)
    assert result.passed
    worse = digits_report().to_dict()
    worse["accuracy"]["quantized"] -= 0.02
    with pytest.raises(AssertionError, match=r"(?s)regressed.*top1 \(int8\).*-2.00 pts.*FAIL"):
        fxquant.assert_no_regression(worse, digits_report(), max_accuracy_drop=1.0)
    assert Report.from_dict(worse).accuracy.drop > digits_report().accuracy.drop


def test_latency_is_compared_at_the_same_batch_size() -> None:
    data = digits_report().to_dict()
    batch_8 = {**data, "latency_ms": {**data["latency_ms"]["by_batch_size"][1], "threads": 1}}
    row = compare(batch_8, digits_report()).rows[2]
    assert row.metric == "speed-up, batch 8 (latency +%)" and row.delta == 0
    batch_3 = copy.deepcopy(batch_8)
    batch_3["latency_ms"]["batch_size"] = 3
    with pytest.raises(ArtifactError, match="no latency at batch size 3"):
        compare(batch_3, digits_report())

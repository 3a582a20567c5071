"""The Report JSON schema: the keys of shared/API.md with the right types, strict JSON, and a lossless round trip."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from report_helpers import API_EXAMPLE, digits_report

from fxquant.errors import ArtifactError
from fxquant.report.schema import SCHEMA_VERSION, Report

# The schema as shared/API.md fixes it: key -> type (nested dicts are sub-schemas).
NUMBER = (int, float)
API_SCHEMA: dict[str, Any] = {
    "schema_version": int, "backend": str, "observer": str,
    "accuracy": {"metric": str, "float": NUMBER, "quantized": NUMBER, "drop": NUMBER},
    "latency_ms": {"float": {"median": NUMBER, "p90": NUMBER}, "quantized": {"median": NUMBER, "p90": NUMBER},
                   "speedup": NUMBER},
    "size_bytes": {"float": int, "quantized": int},
    "layers": list,
}

def check_schema(data: dict[str, Any], schema: dict[str, Any], where: str = "report") -> None:
    for key, expected in schema.items():
        assert key in data, f"{where}: missing {key!r}"
        if isinstance(expected, dict):
            check_schema(data[key], expected, f"{where}.{key}")
        else:
            assert isinstance(data[key], expected) and not isinstance(data[key], bool), f"{where}.{key}={data[key]!r}"


def test_to_dict_has_every_api_key_with_its_type() -> None:
    data = digits_report().to_dict()
    check_schema(data, API_SCHEMA)
    assert data["schema_version"] == SCHEMA_VERSION == 1
    acc, lat = data["accuracy"], data["latency_ms"]
    assert acc["drop"] == pytest.approx(acc["float"] - acc["quantized"])
    assert lat["speedup"] == pytest.approx(lat["float"]["median"] / lat["quantized"]["median"])
    assert [layer["name"] for layer in data["layers"]] == ["conv1", "conv2", "fc1", "fc2"]
    for layer in data["layers"]:
        assert isinstance(layer["name"], str) and isinstance(layer["quantized"], bool)
        if layer["quantized"]:
            assert isinstance(layer["sqnr_db"], float)
        else:
            assert layer["reason"] == "excluded by config"


def test_json_is_strict_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    text = digits_report().to_json(path)
    assert path.read_text() == text

    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    data = json.loads(text, parse_constant=refuse)
    assert data == digits_report().to_dict()
    again = Report.from_json(path)
    assert again == digits_report()
    assert again.to_dict() == digits_report().to_dict()


def test_infinite_sqnr_is_written_as_null_and_read_back() -> None:
    data = copy.deepcopy(API_EXAMPLE)
    data["layers"][0]["sqnr_db"] = None
    report = Report.from_dict(data)
    assert report.layers[0].sqnr_db == math.inf
    assert report.to_dict()["layers"][0]["sqnr_db"] is None
    assert "sqnr_db" not in report.to_dict()["layers"][1]


def test_a_report_with_only_the_api_keys_loads() -> None:
    report = Report.from_dict(API_EXAMPLE)
    assert report.accuracy.points_per_unit == 100  # top1 drops are compared in percentage points
    assert report.latency.headline.speedup == 2.0 and report.fidelity is None
    check_schema(report.to_dict(), API_SCHEMA)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(schema_version=2), "schema_version 2"),
    (lambda d: d.pop("schema_version"), "schema_version None"),
    (lambda d: d.pop("accuracy"), "missing key 'accuracy'"),
    (lambda d: d["accuracy"].update(float="high"), "accuracy.float: expected a number"),
    (lambda d: d["latency_ms"]["quantized"].pop("p90"), "latency_ms.quantized: missing key 'p90'"),
    (lambda d: d["layers"][1].update(quantized="no"), "layers[1].quantized: expected true/false"),
    (lambda d: d["size_bytes"].update(float=True), "size_bytes.float: expected a number"),
])
def test_malformed_reports_raise_artifact_error_naming_the_key(change: Any, message: str) -> None:
    data = copy.deepcopy(API_EXAMPLE)
    change(data)
    with pytest.raises(ArtifactError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Report.from_dict(data, source="baseline.json")


def test_unreadable_files_raise_artifact_error(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"schema_version": 1, "backend": ')
    with pytest.raises(ArtifactError, match="not valid JSON"):
        Report.from_json(corrupt)
    with pytest.raises(ArtifactError, match="cannot read"):
        Report.from_json(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        Report.from_json(tmp_path / "list.json")

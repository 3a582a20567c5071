"""``fxquant export RUN_DIR -o FILE`` and ``fxquant inspect FILE``: the file and its manifest are written, the
manifest's SHA-256 is checked, and every refusal is exit status 2 with one error line and nothing written.

The commands run in this process (``fxquant.cli.main``, the console script's code path without torch start-up per
call) on the trained digits CNN."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_testing import error_line, main_cli, trusted_copy

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.models.digits import digits_cnn
from fxquant.testing import relowered

pytestmark = pytest.mark.skipif("onednn" not in available_backends(), reason="the runs are converted for onednn")
MODEL = ("--model", "fxquant.models:digits_cnn", "--example-inputs", "1x1x8x8")
FORMATS = {".onnx": "onnx", ".pt2": "export"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, digits_weights: Path) -> tuple[Path, Path]:
    """A calibrated run directory and a copy of it converted for onednn."""
    root = tmp_path_factory.mktemp("runs")
    calibrated = root / "calibrated"
    assert main_cli("prepare", *MODEL, "--weights", str(digits_weights), "-o", str(calibrated)).returncode == 0
    assert main_cli("calibrate", str(calibrated), "--data", "cli_helpers:calib_batches").returncode == 0
    converted = trusted_copy(calibrated, root / "converted")
    assert main_cli("convert", str(converted), "--backend", "onednn").returncode == 0
    return calibrated, converted


@pytest.fixture(scope="module")
def exports(runs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """suffix -> the file ``fxquant export`` wrote from the converted run (no .onnx without the 'onnx' extra)."""
    root = tmp_path_factory.mktemp("exports")
    written = {}
    for suffix in (s for s in FORMATS if s != ".onnx" or _onnx_installed()):
        outcome = main_cli("export", str(runs[1]), "-o", str(root / f"model{suffix}"))
        assert outcome.returncode == 0, outcome.stderr
        written[suffix] = root / f"model{suffix}"
    return written


def _needs_onnx() -> None:
    for package in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(package, reason=f"the optional 'onnx' extra ({package}) is not installed")


def _onnx_installed() -> bool:
    return all(importlib.util.find_spec(package) for package in ("onnx", "onnxscript", "onnxruntime"))


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".fxquant.json")


def _digits(weights: Path) -> torch.nn.Module:
    model = digits_cnn()
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model


def _ort_output(path: Path, x: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


@pytest.mark.parametrize("suffix", list(FORMATS))
def test_export_writes_the_file_and_its_manifest(suffix: str, exports: dict[str, Path]) -> None:
    if suffix == ".onnx":
        _needs_onnx()
    path = exports[suffix]
    manifest = json.loads(_sidecar(path).read_text())
    assert manifest["export_format"] == FORMATS[suffix] and manifest["file"] == path.name
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["backend"] == "onednn" and manifest["dynamic_axes"] == [[0]]


INPUTS = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(5))


def test_the_pt2_is_the_reference_conversion_of_the_run(runs: tuple[Path, Path], exports: dict[str, Path],
                                                         digits_weights: Path) -> None:
    # the reference arithmetic on the run's own qparams (7-bit activations where onednn has no VNNI to use)
    reference = relowered(fxquant.load(runs[1], _digits(digits_weights)), "reference")
    (got,) = torch.export.load(str(exports[".pt2"])).module()(INPUTS)  # a flat tuple of tensors (docs/export.md)
    assert torch.equal(got, reference(INPUTS))


def test_the_onnx_is_what_python_exports_for_the_run(runs: tuple[Path, Path], exports: dict[str, Path],
                                                     digits_weights: Path, tmp_path: Path) -> None:
    _needs_onnx()
    python_export = fxquant.export(fxquant.load(runs[1], _digits(digits_weights)), tmp_path / "python.onnx")
    assert torch.equal(_ort_output(exports[".onnx"], INPUTS), _ort_output(python_export, INPUTS))


@pytest.mark.parametrize("suffix", list(FORMATS))
def test_inspect_verifies_the_file_and_detects_tampering(suffix: str, exports: dict[str, Path],
                                                         tmp_path: Path) -> None:
    if suffix == ".onnx":
        _needs_onnx()
    path = tmp_path / exports[suffix].name
    shutil.copy(exports[suffix], path)
    shutil.copy(_sidecar(exports[suffix]), _sidecar(path))
    outcome = main_cli("inspect", str(path))
    assert outcome.returncode == 0, outcome.stderr
    assert "SHA-256 verified" in outcome.stdout, outcome.stdout
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    tampered = main_cli("inspect", str(path))
    assert tampered.returncode == 2, tampered.stdout
    assert "does not match the SHA-256" in error_line(tampered, "inspect")


def _refused(*args: str) -> str:
    outcome = main_cli("export", *args)
    assert outcome.returncode == 2, outcome.stdout + outcome.stderr
    assert len(outcome.stderr.strip().splitlines()) == 1, outcome.stderr
    return error_line(outcome, "export")


def test_a_run_that_was_never_converted_is_refused(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    assert "convert" in _refused(str(runs[0]), "-o", str(out))
    assert not out.exists() and not _sidecar(out).exists()


@pytest.mark.parametrize("suffix", list(FORMATS))
def test_an_existing_file_is_kept_unless_overwrite(suffix: str, runs: tuple[Path, Path], tmp_path: Path) -> None:
    if suffix == ".onnx":
        _needs_onnx()
    out = tmp_path / f"model{suffix}"
    out.write_bytes(b"the user's own file")
    assert "--overwrite" in _refused(str(runs[1]), "-o", str(out))
    assert out.read_bytes() == b"the user's own file" and not _sidecar(out).exists()
    assert main_cli("export", str(runs[1]), "-o", str(out), "--overwrite").returncode == 0
    assert json.loads(_sidecar(out).read_text())["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()


def test_an_existing_manifest_is_kept_unless_overwrite(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "model.pt2"
    _sidecar(out).write_text("{}")
    _refused(str(runs[1]), "-o", str(out))
    assert not out.exists() and _sidecar(out).read_text() == "{}"


def test_a_name_without_a_known_suffix_needs_format(runs: tuple[Path, Path], tmp_path: Path) -> None:
    _needs_onnx()
    out = tmp_path / "model.bin"
    line = _refused(str(runs[1]), "-o", str(out))
    assert "model.bin" in line and "format" in line, line
    assert not out.exists() and not _sidecar(out).exists()
    outcome = main_cli("export", str(runs[1]), "-o", str(out), "--format", "onnx")
    assert outcome.returncode == 0, outcome.stderr
    assert json.loads(_sidecar(out).read_text())["export_format"] == "onnx"
    assert _ort_output(out, torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_an_onednn_run_is_not_exported_as_torchscript(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    assert "onednn" in _refused(str(runs[1]), "-o", str(out))
    assert not out.exists() and not _sidecar(out).exists()

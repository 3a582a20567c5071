"""``--data``: tensor files, ``save_to_disk`` directories (columns, transform), functions, and hub names."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_testing import error_line, main_cli

from fxquant.cli.data import DataOptions, load_data
from fxquant.errors import ArtifactError, InputError


def _batches(spec: str | Path, **options: object) -> list:
    return list(load_data(DataOptions(str(spec), **options)))  # type: ignore[arg-type]


def test_npy_file_is_cut_into_batches(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.ones((10, 1, 8, 8), dtype=np.float32))
    batches = _batches(tmp_path / "x.npy", batch_size=4)
    assert [tuple(b.shape) for b in batches] == [(4, 1, 8, 8), (4, 1, 8, 8), (2, 1, 8, 8)]


def test_npz_gives_tuples_in_file_order_or_columns_order(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", images=np.zeros((6, 3), np.float32), labels=np.arange(6))
    images, labels = _batches(tmp_path / "d.npz", batch_size=6)[0]
    assert images.shape == (6, 3) and labels.tolist() == list(range(6))
    only = _batches(tmp_path / "d.npz", batch_size=3, columns=("labels",))
    assert [b.tolist() for b in only] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(InputError, match=r"no column 'label'.*Did you mean 'labels'"):
        _batches(tmp_path / "d.npz", columns=("label",))


def test_pt_file_loads_with_weights_only(tmp_path: Path) -> None:
    torch.save({"x": torch.zeros(5, 2), "y": torch.ones(5)}, tmp_path / "d.pt")
    assert [tuple(b[0].shape) for b in _batches(tmp_path / "d.pt", batch_size=2, columns=("x", "y"))] == [
        (2, 2), (2, 2), (1, 2)]
    torch.save({"x": os.getcwd}, tmp_path / "evil.pt")  # a pickled function reference
    with pytest.raises(ArtifactError, match="refused to load"):
        _batches(tmp_path / "evil.pt")


def test_function_spec_and_bare_tensor_result() -> None:
    assert len(_batches("cli_helpers:calib_batches")) == 6
    assert len(_batches("fxquant.models.digits:digits_calibration_data")) == 3


def test_save_to_disk_directory_with_columns_and_transform(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from fxquant.models.digits import load_digits_splits

    images, labels = load_digits_splits()["calib"]
    table = {"image": (images * 16).round().to(torch.uint8).numpy().tolist(), "label": labels.tolist()}
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "digits"))
    batches = _batches(tmp_path / "digits", batch_size=64, columns=("image", "label"),
                       transform="cli_helpers:pixels_to_unit_range")
    assert len(batches) == 3 and batches[0][0].dtype == torch.float32 and float(batches[0][0].max()) <= 1.0

    run = tmp_path / "run"
    assert main_cli("prepare", "--model", "fxquant.models:digits_cnn", "--example-inputs", "1x1x8x8",
                    "-o", str(run)).returncode == 0
    outcome = main_cli("calibrate", str(run), "--data", str(tmp_path / "digits"), "--columns", "image",
                       "--transform", "cli_helpers:pixels_to_unit_range", "--batch-size", "64")
    assert outcome.returncode == 0, outcome.stderr
    bad = main_cli("calibrate", str(run), "--data", str(tmp_path / "digits"), "--columns", "img")
    assert bad.returncode == 2 and "Did you mean 'image'?" in error_line(bad, "calibrate")


def test_hub_name_without_network_fails_fast_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.fxquant-test.invalid")  # .invalid never resolves
    with pytest.raises(InputError, match=r"cannot resolve hub\.fxquant-test\.invalid.*save_to_disk"):
        _batches("someuser/digits")


def test_paths_that_do_not_exist(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or directory"):
        _batches("./no/such/dir")
    with pytest.raises(InputError, match="no such file"):
        _batches(tmp_path / "missing.npz")

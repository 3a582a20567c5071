"""Data adapters: HF datasets (in memory, from local files, load_from_disk), transforms, numpy, dict batches."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from calib_helpers import observer_state
from torch import nn

import fxquant
from fxquant.calibration import iterate_batches
from fxquant.errors import InputError


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)


ROWS = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)


def prepared() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return fxquant.prepare(KeywordNet().eval(), (torch.randn(2, 4),), fxquant.QuantConfig(activation="minmax"))


def reference_state() -> dict[str, dict[str, torch.Tensor]]:
    gm = prepared()
    fxquant.calibrate(gm, [torch.from_numpy(ROWS)], progress=False)
    return observer_state(gm)


def calibrated_state(data: object, **options: object) -> dict[str, dict[str, torch.Tensor]]:
    gm = prepared()
    summary = fxquant.calibrate(gm, data, progress=False, **options)  # type: ignore[arg-type]
    assert summary.samples == len(ROWS)
    return observer_state(gm)


def assert_same_ranges(state: dict[str, dict[str, torch.Tensor]]) -> None:
    reference = reference_state()
    for name, buffers in reference.items():
        assert torch.equal(buffers["min_val"], state[name]["min_val"]), name
        assert torch.equal(buffers["max_val"], state[name]["max_val"]), name


def test_hf_dataset_from_dict_with_extra_columns_dropped() -> None:
    ds = datasets.Dataset.from_dict({"features": ROWS.tolist(), "label": list(range(20)), "text": ["x"] * 20})
    assert_same_ranges(calibrated_state(ds, batch_size=6))


def test_hf_dataset_from_local_json_with_transform(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"a": r[:2].tolist(), "b": r[2:].tolist(), "label": 1}) for r in ROWS))
    ds = datasets.Dataset.from_json(str(path), cache_dir=str(tmp_path / "cache"))

    def to_features(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"features": torch.cat([batch["a"], batch["b"]], dim=1)}

    assert_same_ranges(calibrated_state(ds, batch_size=8, transform=to_features))


def test_hf_dataset_from_csv_and_load_from_disk(tmp_path: Path) -> None:
    csv = tmp_path / "rows.csv"
    csv.write_text("f0,f1,f2,f3,label\n" + "\n".join(",".join(map(repr, r.tolist())) + ",0" for r in ROWS))
    built = datasets.Dataset.from_csv(str(csv), cache_dir=str(tmp_path / "cache"))
    built.save_to_disk(str(tmp_path / "saved"))
    loaded = datasets.load_from_disk(str(tmp_path / "saved"))

    def stack(batch: dict[str, torch.Tensor]) -> torch.Tensor:  # a collate: columns -> one float tensor
        return torch.stack([batch[f"f{i}"] for i in range(4)], dim=1).float()

    assert_same_ranges(calibrated_state(loaded, batch_size=7, transform=stack))


def test_numpy_arrays_tuples_and_dicts() -> None:
    assert_same_ranges(calibrated_state(ROWS))  # one array: one batch
    assert_same_ranges(calibrated_state(np.split(ROWS, 4)))
    assert_same_ranges(calibrated_state([(torch.from_numpy(r), torch.zeros(5)) for r in np.split(ROWS, 2)]))
    assert_same_ranges(calibrated_state([{"features": r, "label": np.zeros(5)} for r in np.split(ROWS, 4)]))


def test_dataloader_and_transform_on_samples() -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(ROWS)), batch_size=5)
    assert_same_ranges(calibrated_state(loader, transform=lambda batch: {"features": batch[0]}))


def test_iterate_batches_applies_transform_lazily_and_rejects_non_iterables() -> None:
    seen: list[int] = []

    def record(batch: int) -> int:
        seen.append(batch)
        return batch * 10

    stream = iterate_batches([1, 2, 3], transform=record)
    assert next(stream) == 10 and seen == [1]
    with pytest.raises(InputError, match="must be iterable"):
        list(iterate_batches(42))  # type: ignore[arg-type]

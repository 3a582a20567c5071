"""Checkpoint and resume: an interrupted run resumed from its checkpoint ends with identical statistics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from calib_helpers import MIXED_OBSERVERS, assert_identical, batches, observer_state, prepared_tiny

import fxquant
from fxquant.calibration import load_checkpoint, observers_of
from fxquant.errors import ArtifactError, ConfigError

DATA = batches(12)


class Interrupted:
    """Yields ``DATA`` but raises KeyboardInterrupt instead of batch ``stop`` (a user's Ctrl-C between batches)."""

    def __init__(self, stop: int) -> None:
        self.stop = stop

    def __iter__(self) -> Iterator[torch.Tensor]:
        for index, batch in enumerate(DATA):
            if index == self.stop:
                raise KeyboardInterrupt
            yield batch


def uninterrupted(activation: str) -> dict[str, dict[str, torch.Tensor]]:
    gm = prepared_tiny(activation, **MIXED_OBSERVERS)
    fxquant.calibrate(gm, DATA, progress=False)
    return observer_state(gm)


@pytest.mark.parametrize("activation", ["histogram", "minmax"])
@pytest.mark.parametrize("stop", [1, 7])
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path: Path, activation: str, stop: int) -> None:
    path = tmp_path / "calib.ckpt"
    gm = prepared_tiny(activation, **MIXED_OBSERVERS)
    with pytest.raises(KeyboardInterrupt):
        fxquant.calibrate(gm, Interrupted(stop), checkpoint=path, checkpoint_every=3, progress=False)
    assert path.exists() == (stop >= 3)
    fresh = prepared_tiny(activation, **MIXED_OBSERVERS)  # a new process would start from a freshly prepared model
    summary = fxquant.calibrate(fresh, DATA, checkpoint=path, checkpoint_every=3, resume=True, progress=False)
    assert summary.batches == len(DATA) and summary.samples == 4 * len(DATA)
    assert summary.resumed_batches == 3 * (stop // 3)
    assert_identical(observer_state(fresh), uninterrupted(activation))
    assert [p.name for p in tmp_path.iterdir()] == ["calib.ckpt"]  # no temporary files left behind


def test_resume_into_the_interrupted_model_discards_its_partial_batches(tmp_path: Path) -> None:
    path = tmp_path / "calib.ckpt"
    gm = prepared_tiny("histogram")
    with pytest.raises(KeyboardInterrupt):
        fxquant.calibrate(gm, Interrupted(5), checkpoint=path, checkpoint_every=2, progress=False)
    fxquant.calibrate(gm, DATA, checkpoint=path, checkpoint_every=2, resume=True, progress=False)
    reference = prepared_tiny("histogram")
    fxquant.calibrate(reference, DATA, progress=False)
    assert_identical(observer_state(gm), observer_state(reference))
    assert fxquant.state.quant_state(gm).calibration_samples == 4 * len(DATA)


def test_resume_without_checkpoint_starts_over_and_resume_false_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "calib.ckpt"
    gm = prepared_tiny("minmax")
    fxquant.calibrate(gm, DATA[:4], checkpoint=path, resume=True, progress=False)
    other = prepared_tiny("minmax")
    fxquant.calibrate(other, DATA[:2], checkpoint=path, resume=False, progress=False)
    restored = prepared_tiny("minmax")
    assert load_checkpoint(path, observers_of(restored)).batches == 2
    assert_identical(observer_state(restored), observer_state(other))


def test_layout_mismatch_raises_artifact_error(tmp_path: Path) -> None:
    path = tmp_path / "calib.ckpt"
    fxquant.calibrate(prepared_tiny("histogram"), DATA[:2], checkpoint=path, progress=False)
    for other in (prepared_tiny("minmax"), prepared_tiny("percentile")):
        with pytest.raises(ArtifactError, match="different observer layout"):
            fxquant.calibrate(other, DATA, checkpoint=path, resume=True, progress=False)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_corrupt_checkpoint_raises_artifact_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "calib.ckpt"
    fxquant.calibrate(prepared_tiny("minmax"), DATA[:2], checkpoint=path, progress=False)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint" * 10)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ArtifactError, match=str(path.name)):
        fxquant.calibrate(prepared_tiny("minmax"), DATA, checkpoint=path, resume=True, progress=False)


def test_checkpoint_every_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_every"):
        fxquant.calibrate(prepared_tiny("minmax"), DATA, checkpoint=tmp_path / "c", checkpoint_every=0)


def test_resume_skips_consumed_batches_without_transforming_them(tmp_path: Path) -> None:
    path = tmp_path / "calib.ckpt"
    fxquant.calibrate(prepared_tiny("minmax"), DATA[:4], checkpoint=path, progress=False)
    transformed: list[int] = []

    def record(batch: torch.Tensor) -> torch.Tensor:
        transformed.append(len(transformed))
        return batch

    summary = fxquant.calibrate(prepared_tiny("minmax"), DATA, checkpoint=path, resume=True, transform=record,
                                progress=False)
    assert len(transformed) == len(DATA) - 4 and summary.batches == len(DATA) and summary.resumed_batches == 4

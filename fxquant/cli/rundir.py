"""RUN_DIR: the command line's artifact directory, one stage after another.

A run directory is an ordinary fxquant artifact (``fxquant.load(RUN_DIR, model)`` reads it) whose manifest also names
its *source*: the model factory, the weights file and its hash, and the example-input spec. Each later command
rebuilds the model from that source and checks the rebuilt graph against the manifest before doing anything, and
commits its results atomically, so a failing command leaves the directory exactly as it was.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import fx, nn

from fxquant.artifacts.manifest import MANIFEST_NAME, STAGES, Manifest, read_manifest
from fxquant.artifacts.model_io import manifest_for, rebuild
from fxquant.artifacts.store import commit
from fxquant.cli.specs import build_model, parse_example_inputs
from fxquant.config import QuantConfig
from fxquant.errors import ArtifactError, CalibrationError, InputError
from fxquant.serialization import sha256_file, state_dict_sha256


@dataclass(frozen=True)
class Source:
    """Where a run's float model comes from; recorded by ``fxquant prepare``, replayed by every later command."""

    model: str
    example_inputs: str
    weights: str | None = None
    weights_sha256: str | None = None
    model_sha256: str | None = None  # of the float model's state dict, as the factory (+ weights) built it

    @classmethod
    def from_args(cls, model: str, example_inputs: str, weights: str | None) -> Source:
        if weights is None:
            return cls(model, example_inputs)
        path = Path(weights)
        if not path.is_file():
            raise InputError(f"--weights {weights!r}: no such file")
        return cls(model, example_inputs, str(path.resolve()), sha256_file(path))

    @classmethod
    def from_manifest(cls, directory: Path, manifest: Manifest) -> Source:
        if not manifest.source:
            raise ArtifactError(f"{directory} was written by fxquant.save, not by `fxquant prepare`: it does not "
                                "name its model. Load it in Python with fxquant.load(path, model)")
        try:
            return cls(**manifest.source)
        except TypeError as exc:
            raise ArtifactError(f"{directory / MANIFEST_NAME}: invalid source entry ({exc})") from None

    def _check_weights(self) -> None:
        if self.weights is None:
            return
        if not Path(self.weights).is_file():
            raise InputError(f"the weights file {self.weights} recorded by `fxquant prepare` is missing; restore it "
                             "or prepare a new run")
        if sha256_file(self.weights) != self.weights_sha256:
            raise ArtifactError(f"the weights file {self.weights} changed since `fxquant prepare` (SHA-256 "
                                "mismatch); prepare a new run for the new weights")

    def build(self) -> tuple[nn.Module, tuple[Any, ...]]:
        """The float model (eval mode, weights loaded) and the example inputs; checked against the recorded hash."""
        self._check_weights()
        model = build_model(self.model, self.weights)
        if self.model_sha256 is not None and state_dict_sha256(model.state_dict()) != self.model_sha256:
            raise ArtifactError(f"--model {self.model!r} now builds different weights than at `fxquant prepare` "
                                "(the factory or its checkpoint changed, or it is not deterministic); pass the "
                                "weights with --weights, or prepare a new run")
        return model, parse_example_inputs(self.example_inputs)


def _check_target(directory: Path, overwrite: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise InputError(f"-o {directory}: is a file; give a new or empty directory")
    if (directory / MANIFEST_NAME).exists() and not overwrite:
        raise InputError(f"-o {directory} already holds a run; choose a new directory or pass --overwrite")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST_NAME).exists():
        raise InputError(f"-o {directory} is not empty and holds no fxquant run; choose a new or empty directory")


def create_run(directory: Path, source: Source, config: QuantConfig, *,
               overwrite: bool = False) -> tuple[Manifest, fx.GraphModule]:
    """``fxquant prepare``: build, prepare and record a new run; returns its manifest and the prepared model."""
    from fxquant.api import prepare

    _check_target(directory, overwrite)
    model, example = source.build()
    prepared = prepare(model, example, config)
    manifest, _ = manifest_for(prepared)
    source = dataclasses.replace(source, model_sha256=state_dict_sha256(model.state_dict()))
    manifest.source = dataclasses.asdict(source)
    manifest.record("prepared", model=source.model)
    commit(directory, manifest)
    return manifest, prepared


def open_run(directory: str | Path, *, needs: str = "prepared") -> tuple[Path, Manifest]:
    """Read RUN_DIR's manifest and check the run reached the stage ``needs``."""
    path = Path(directory)
    manifest = read_manifest(path)
    if STAGES.index(manifest.stage) < STAGES.index(needs):
        step = {"calibrated": "fxquant calibrate RUN_DIR --data ...", "converted": "fxquant convert RUN_DIR"}[needs]
        raise CalibrationError(f"{path} is at stage {manifest.stage!r}, this command needs a {needs} run; run "
                               f"`{step}` first")
    return path, manifest


def rebuild_run(directory: Path, manifest: Manifest, *,
                stage: str | None = None) -> tuple[nn.Module, fx.GraphModule]:
    """The float model and the run's model rebuilt up to ``stage`` (default: the stage it reached)."""
    source = Source.from_manifest(directory, manifest)
    model, example = source.build()
    target = manifest if stage is None else dataclasses.replace(manifest, stage=stage)
    return model, rebuild(directory, target, model, example)


def advance(directory: Path, manifest: Manifest, stage: str, tensors: dict[str, Any], **details: Any) -> None:
    """Commit ``stage``'s tensors and the manifest; results of stages after it are dropped (they are stale)."""
    if stage == "calibrated":
        for mapping in (manifest.graphs, manifest.fingerprints):
            mapping.pop("converted", None)
        manifest.files.pop("quantized", None)
        manifest.backend, manifest.layer_backends = None, {}
    manifest.record(stage, **details)
    commit(directory, manifest, tensors)

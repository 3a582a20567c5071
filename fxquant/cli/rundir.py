"""RUN_DIR: the command line's artifact directory, one stage after another.

A run directory is an ordinary fxquant artifact (``fxquant.load(RUN_DIR, model)`` reads it) whose manifest also names
its *source* (:mod:`fxquant.cli.source`): the model factory, the weights file's name and hash, and the example-input
spec; the example inputs themselves are stored in it as tensors. Each later command authorizes the import of the
factory (the run directory alone never can), rebuilds the model, checks the rebuilt graph against the manifest
before doing anything, and commits its results atomically, so a failing command leaves the directory as it was.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from fxquant.artifacts.manifest import MANIFEST_NAME, STAGES, Manifest, read_manifest
from fxquant.artifacts.model_io import manifest_for, rebuild
from fxquant.artifacts.store import commit, load_role
from fxquant.cli.source import Recipe, Source, TrustOptions, authorize
from fxquant.cli.trust import remember
from fxquant.config import QuantConfig
from fxquant.errors import ArtifactError, CalibrationError, InputError
from fxquant.serialization import state_dict_sha256
from fxquant.state import graph_of

INPUTS = "inputs"  # the files role of the stored example inputs: {"example_inputs": tuple}
_PLAIN = (int, float, bool, str, type(None))
_NO_OPTIONS = TrustOptions()  # no --model/--weights/--trust-model-spec: the trust record decides


class Rebuilt(NamedTuple):
    """A run rebuilt by a later stage: the float model, the run's model at the stage asked for, the example inputs."""

    float_model: nn.Module
    model: nn.Module  # a GraphModule, or a drop-in model (fxquant.state.drop_in)
    example_inputs: tuple[Any, ...]

    @property
    def graph(self) -> fx.GraphModule:
        """``model`` as the GraphModule fxquant keeps its state on (a prepared model is one already)."""
        return graph_of(self.model)


def _check_target(directory: Path, overwrite: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise InputError(f"-o {directory}: is a file; give a new or empty directory")
    if (directory / MANIFEST_NAME).exists() and not overwrite:
        raise InputError(f"-o {directory} already holds a run; choose a new directory or pass --overwrite")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST_NAME).exists():
        raise InputError(f"-o {directory} is not empty and holds no fxquant run; choose a new or empty directory")


class _NotPlain(Exception):
    pass


def _plain_copy(value: Any) -> Any:
    """``value`` as compact copies of plain tensors and containers: what ``weights_only`` loads back."""
    if type(value) is torch.Tensor:
        return value.detach().clone()
    if type(value) in _PLAIN:
        return value
    if type(value) in (tuple, list):
        return type(value)(_plain_copy(v) for v in value)
    if type(value) is dict and all(type(k) is str for k in value):
        return {k: _plain_copy(v) for k, v in value.items()}
    raise _NotPlain


def _inputs_file(example: tuple[Any, ...]) -> dict[str, Any]:
    """The tensors to store for the example inputs (none when they are not plain data: then later stages call the
    example-input factory again, as trusted code)."""
    try:
        return {INPUTS: {"example_inputs": _plain_copy(example)}}
    except _NotPlain:
        return {}


def create_run(directory: Path, source: Source, recipe: Recipe, config: QuantConfig, *,
               overwrite: bool = False) -> tuple[Manifest, fx.GraphModule]:
    """``fxquant prepare``: build, prepare and record a new run (and vouch for it); returns its manifest and the
    prepared model."""
    from fxquant.api import prepare

    _check_target(directory, overwrite)
    model = recipe.build(source)
    example = recipe.example_inputs(source.example_inputs, model)
    prepared = prepare(model, example, config)
    manifest, _ = manifest_for(prepared)
    source = dataclasses.replace(source, model_sha256=state_dict_sha256(model.state_dict()))
    manifest.source = dataclasses.asdict(source)
    manifest.record("prepared", model=source.model)
    commit(directory, manifest, _inputs_file(example))
    remember(directory, source.trusted_run(recipe.weights))
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


def _stored_inputs(directory: Path, manifest: Manifest) -> tuple[Any, ...]:
    value = load_role(directory, manifest, INPUTS).get("example_inputs")
    if not isinstance(value, (tuple, list)):
        raise ArtifactError(f"{directory}: the inputs file holds no tuple of example inputs")
    return tuple(value)


def rebuild_run(directory: Path, manifest: Manifest, options: TrustOptions = _NO_OPTIONS, *,
                stage: str | None = None) -> Rebuilt:
    """The float model and the run's model rebuilt up to ``stage`` (default: the stage it reached).

    Nothing is imported before :func:`fxquant.cli.source.authorize` allowed it for this user, this directory and
    ``options`` (the command line's ``--model`` / ``--weights`` / ``--trust-model-spec``).
    """
    source = Source.from_manifest(directory, manifest)
    stored = INPUTS in manifest.files
    recipe = authorize(directory, source, options, inputs_stored=stored)
    model = recipe.build(source)
    example = _stored_inputs(directory, manifest) if stored else recipe.example_inputs(source.example_inputs, model)
    target = manifest if stage is None else dataclasses.replace(manifest, stage=stage)
    rebuilt = Rebuilt(model, rebuild(directory, target, model, example), example)
    if target.stage == "converted":  # the accuracy-budget search that chose the model, for fxquant report to show
        from fxquant.report.trials import TRIALS_KEY, recorded_trials  # lazily: commands without report need not

        rebuilt.graph.meta[TRIALS_KEY] = recorded_trials(manifest.history)
    if recipe.remember:
        remember(directory, source.trusted_run(recipe.weights))
    return rebuilt


def advance(directory: Path, manifest: Manifest, stage: str, tensors: dict[str, Any], **details: Any) -> None:
    """Commit ``stage``'s tensors and the manifest; results of stages after it are dropped (they are stale)."""
    if stage == "calibrated":
        for mapping in (manifest.graphs, manifest.fingerprints):
            mapping.pop("converted", None)
        manifest.files.pop("quantized", None)
        manifest.backend, manifest.layer_backends = None, {}
    manifest.record(stage, **details)
    commit(directory, manifest, tensors)

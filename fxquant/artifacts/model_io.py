"""``fxquant.save`` / ``fxquant.load``: artifacts that are plain state dicts plus a JSON manifest, never code.

A quantized model is a deterministic function of the float model, the config, the example-input specs, the observer
statistics and the backend. So an artifact stores only those statistics (and, for checking, the quantized state
dict), and ``load`` rebuilds the model with ``prepare`` -> load statistics -> ``convert``. Nothing in the file is
executed or unpickled beyond tensors, and the rebuilt graph and weights are checked against what was saved.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxquant.artifacts.fingerprint import check_graph, fingerprint, graph_summary
from fxquant.artifacts.manifest import Manifest, input_spec_dicts, read_manifest
from fxquant.artifacts.store import commit, load_role
from fxquant.calibration import observers_of
from fxquant.errors import ArtifactError
from fxquant.passes import ChannelRangeObserver
from fxquant.state import graph_of, quant_state, update_state

ModelOrFactory = nn.Module | Callable[[], nn.Module]


def set_graph(manifest: Manifest, kind: str, gm: fx.GraphModule) -> None:
    """Record ``gm``'s summary and fingerprint as the manifest's ``kind`` ("prepared"/"converted") graph."""
    manifest.graphs[kind] = graph_summary(gm)
    manifest.fingerprints[kind] = fingerprint(manifest.graphs[kind])


def set_converted(manifest: Manifest, quantized: fx.GraphModule) -> None:
    """Record what rebuilding ``quantized`` takes besides statistics: its backend, auto's per-layer choices (replayed
    on load, not measured again), the layers convert() kept float (an accuracy-budget search's result) or switched
    to another scheme, and its graph."""
    state = quant_state(quantized)
    manifest.backend, manifest.layer_backends = state.backend, dict(state.layer_backends)
    manifest.keep_float, manifest.schemes = list(state.keep_float), dict(state.schemes)
    manifest.smoothquant_alphas = dict(state.smoothquant_alphas)
    set_graph(manifest, "converted", quantized)


def observer_statistics(prepared: fx.GraphModule) -> dict[str, torch.Tensor]:
    """The observers' state-dict entries (``observer_0.min_val``, ...), detached copies."""
    return {f"{name}.{key}": value.detach().clone()
            for name, obs in observers_of(prepared).items() for key, value in obs.state_dict().items()}


def tensor_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def manifest_for(model: nn.Module) -> tuple[Manifest, dict[str, Any]]:
    """A manifest and the tensors (role -> state dict) describing a prepared, calibrated or converted model (a
    drop-in model: the GraphModule behind it, so a saved artifact is the same either way)."""
    model = graph_of(model)
    state = quant_state(model)
    manifest = Manifest(stage=state.stage, config=state.config.to_dict(),
                        example_inputs=input_spec_dicts(state.example_inputs), backend=state.backend,
                        calibration_samples=state.calibration_samples)
    if state.stage == "converted":
        set_converted(manifest, model)
        return manifest, {"observers": dict(state.observer_state), "quantized": tensor_state(model)}
    set_graph(manifest, "prepared", model)
    if not any(obs.has_data for obs in observers_of(model).values()):
        return manifest, {}
    manifest.stage = "calibrated"
    return manifest, {"observers": observer_statistics(model)}


def save(model: nn.Module, path: str | Path) -> Path:
    """Save a prepared, calibrated or converted model as an artifact directory; returns the directory.

    The directory holds ``manifest.json`` and content-addressed tensor files (``observers-<hash>.pt``,
    ``quantized-<hash>.pt``); it is replaced atomically, so a reader never sees half an artifact. Example::

        fxquant.save(qmodel, "digits-int8")
        qmodel = fxquant.load("digits-int8", model)   # model: the float nn.Module, or a zero-argument factory
    """
    manifest, tensors = manifest_for(model)
    manifest.record(manifest.stage, via="fxquant.save")
    commit(path, manifest, tensors)
    return Path(path)


def _materialize(model: ModelOrFactory) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise ArtifactError(f"load() needs the float nn.Module (or a zero-argument factory), got "
                            f"{type(model).__name__}")
    built = model()
    if not isinstance(built, nn.Module):
        raise ArtifactError(f"the factory {model!r} returned {type(built).__name__}, not an nn.Module")
    return built.eval()  # a model we built ourselves; a module passed in is the caller's (prepare checks its mode)


def load(path: str | Path, model: ModelOrFactory) -> nn.Module:
    """Rebuild the model saved at ``path`` from its float original ``model`` (an ``nn.Module`` or a factory).

    Raises ``ArtifactError`` when a file was tampered with or truncated, was written by a newer fxquant, holds
    anything but tensors, or when ``model``'s graph or weights no longer match. Example::

        qmodel = fxquant.load("digits-int8", fxquant.models.train_digits_cnn)
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    return rebuild(directory, manifest, _materialize(model))


def rebuild(directory: Path, manifest: Manifest, model: nn.Module,
            example_inputs: tuple[Any, ...] | None = None) -> nn.Module:
    """``prepare`` -> load statistics -> ``convert`` as far as ``manifest.stage``, checking each step."""
    from fxquant.api import convert, prepare

    if example_inputs is None:
        with torch.random.fork_rng(devices=[]):  # random example values must not shift the caller's RNG stream
            example_inputs = tuple(s.make() for s in manifest.input_specs())
    prepared = prepare(model, example_inputs, manifest.quant_config())
    if "prepared" in manifest.graphs:
        check_graph(prepared, manifest.graphs["prepared"], "prepared")
    if manifest.stage == "prepared":
        return prepared
    load_observer_statistics(prepared, load_role(directory, manifest, "observers"))
    update_state(prepared, calibration_samples=manifest.calibration_samples,
                 smoothquant_alphas=dict(manifest.smoothquant_alphas))
    if manifest.stage == "calibrated":
        return prepared
    quantized = convert(prepared, backend=manifest.backend, keep_float=manifest.keep_float,
                        layer_backends=manifest.layer_backends or None, schemes=manifest.schemes)
    if "converted" in manifest.graphs:
        check_graph(graph_of(quantized), manifest.graphs["converted"], "converted")
    check_weights(graph_of(quantized), load_role(directory, manifest, "quantized"))
    return quantized


def load_observer_statistics(prepared: fx.GraphModule, statistics: dict[str, Any]) -> None:
    """Load saved statistics into ``prepared``'s observers; the set of entries must match exactly."""
    expected = observer_statistics(prepared)
    if set(statistics) != set(expected):
        missing, extra = sorted(set(expected) - set(statistics)), sorted(set(statistics) - set(expected))
        raise ArtifactError(f"the model's graph no longer matches the artifact: observer statistics missing for "
                            f"{missing[:3] or 'none'}, saved for unknown observers {extra[:3] or 'none'}")
    observers = observers_of(prepared)
    for key, value in statistics.items():
        name, _, attr = key.rpartition(".")
        target, observer = expected[key], observers[name]
        if isinstance(observer, ChannelRangeObserver) and isinstance(value, torch.Tensor) \
                and value.shape != target.shape and observer.take_recorded(attr, value):
            continue  # sampled rows a converted model saved empty: its choices come recorded in the manifest
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            raise ArtifactError(f"observer statistic {key}: saved shape {getattr(value, 'shape', None)} does not "
                                f"fit the model's {tuple(target.shape)}")
        getattr(observer, attr).copy_(value)


def check_weights(quantized: nn.Module, saved: dict[str, Any]) -> None:
    """The rebuilt quantized weights must equal the saved ones (within one int8 step, for torch-version drift).

    This catches the most common silent failure: the right architecture with the wrong weights (a forgotten
    checkpoint), which would otherwise rebuild a model that runs but predicts garbage.
    """
    rebuilt = tensor_state(quantized)
    if set(rebuilt) != set(saved):
        raise ArtifactError("the model's graph no longer matches the artifact: its quantized state dict has "
                            f"different entries ({sorted(set(rebuilt) ^ set(saved))[:3]})")
    for key, value in rebuilt.items():
        if not _close(value, saved[key]):
            raise ArtifactError(f"the model's weights differ from those the artifact was made from ({key} does "
                                "not match); pass the float model with the weights it was quantized from")


def _close(a: torch.Tensor, b: Any) -> bool:
    if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6))
    return a.numel() == 0 or int((a.long() - b.long()).abs().max()) <= 1


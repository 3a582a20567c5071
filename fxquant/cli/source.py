"""A run's source (the model factory, weights and example inputs it was prepared from) and what a stage may import.

The manifest records the source as data: the model spec, the example-input spec, the weights file's *name* and
SHA-256 (never a path to open) and the hash of the model's state dict. Rebuilding the float model means importing
the factory, so every stage after ``prepare`` asks :func:`authorize` first, before anything is imported. It allows
the import when one of these holds, and otherwise raises a one-line ``InputError`` naming the fix:

* this user prepared the run at this path (:mod:`fxquant.cli.trust`) and the manifest still names what they
  prepared it with;
* the user names the model again, ``--model SPEC`` (plus ``--weights FILE`` when the run records weights): it must be
  the manifest's spec and the file must have the recorded SHA-256; the rebuilt model is then checked against the
  recorded state-dict hash and graph fingerprint like any rebuild;
* ``--trust-model-spec``: what will be imported and called is printed to stderr first.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fxquant.artifacts.manifest import MANIFEST_NAME, Manifest
from fxquant.cli.hf import is_hf_spec, normalize_model_spec
from fxquant.cli.specs import TOKENS, build_model, parse_example_inputs
from fxquant.cli.trust import TrustedRun, lookup, trust_file
from fxquant.errors import ArtifactError, InputError
from fxquant.serialization import sha256_file, state_dict_sha256

_CODE_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # PKG.MODULE:NAME, nothing else
_SHAPES = re.compile(r"^\d+(x\d+)*(,\s*\d+(x\d+)*)*$")
DEFAULT_TOKENS = "tokens:1x32"  # a Hugging Face model's example inputs when --example-inputs is not given


@dataclass(frozen=True)
class Source:
    """What a run's float model is made from, as its manifest records it: data, checked before anything is used."""

    model: str
    example_inputs: str
    weights: str | None = None  # the weights file's name, for people (runs of older fxquant: a path); never opened
    weights_sha256: str | None = None
    model_sha256: str | None = None  # of the float model's state dict, as the factory (+ weights) built it

    @classmethod
    def from_manifest(cls, directory: Path, manifest: Manifest) -> Source:
        if not manifest.source:
            raise ArtifactError(f"{directory} was written by fxquant.save, not by `fxquant prepare`: it does not "
                                "name its model. Load it in Python with fxquant.load(path, model)")
        fields = {f.name for f in dataclasses.fields(cls)}
        entry = manifest.source
        if (not isinstance(entry, dict) or not set(entry) <= fields or not {"model", "example_inputs"} <= set(entry)
                or not all(v is None or isinstance(v, str) for v in entry.values())):
            raise ArtifactError(f"{directory / MANIFEST_NAME}: invalid source entry {entry!r}")
        source = cls(**entry)
        model_ok = _CODE_REF.match(source.model) or (is_hf_spec(source.model) and source.model.isprintable())
        if not model_ok or not (_CODE_REF.match(source.example_inputs) or _SHAPES.match(source.example_inputs)
                                or TOKENS.match(source.example_inputs)):
            raise ArtifactError(f"{directory / MANIFEST_NAME}: the source names {source.model!r} / "
                                f"{source.example_inputs!r}, not PKG.MODULE:NAME or transformers:FOLDER specs (or "
                                "shapes)")
        return source

    def vouched_by(self, trusted: TrustedRun | None) -> bool:
        """The trust record names exactly what this manifest asks to import and load."""
        return trusted is not None and (trusted.model, trusted.example_inputs, trusted.weights_sha256) == (
            self.model, self.example_inputs, self.weights_sha256)

    def trusted_run(self, weights: Path | None) -> TrustedRun:
        return TrustedRun(self.model, self.example_inputs, str(weights) if weights else None, self.weights_sha256)


@dataclass(frozen=True)
class TrustOptions:
    """The command line's say over what a run directory may import: ``--model``, ``--weights``,
    ``--trust-model-spec``."""

    model: str | None = None
    weights: str | None = None
    trust_spec: bool = False


@dataclass(frozen=True)
class Recipe:
    """What a stage may import and open to build the float model: made by ``prepare`` from the command line, and by
    :func:`authorize` for later stages."""

    model: str
    weights: Path | None = None
    example_factory: str | None = None  # a PKG.MODULE:FUNCTION it may call (runs that do not store their inputs)
    remember: bool = False  # the user named the model or its weights: record the run in the trust record

    def build(self, source: Source) -> nn.Module:
        """The float model (eval mode, weights loaded); checked against the recorded state-dict hash."""
        model = build_model(self.model, None if self.weights is None else str(self.weights))
        if source.model_sha256 is not None and state_dict_sha256(model.state_dict()) != source.model_sha256:
            raise ArtifactError(f"--model {self.model!r} now builds different weights than at `fxquant prepare` "
                                "(the factory or its checkpoint changed, or it is not deterministic); pass the "
                                "weights with --weights, or prepare a new run")
        return model

    def example_inputs(self, spec: str, model: nn.Module) -> tuple[Any, ...]:
        """Shapes and ``tokens:BxT`` are parsed; a factory is called only when it was authorized (not an assert: it
        guards imports)."""
        if is_factory(spec) and spec != self.example_factory:
            raise ArtifactError(f"the example-input factory {spec!r} was not authorized; pass --trust-model-spec")
        return parse_example_inputs(spec, model)


def is_factory(spec: str) -> bool:
    """An example-input spec that names code to call (``PKG.MODULE:FUNCTION``), not shapes or ``tokens:BxT``."""
    return ":" in spec and not TOKENS.match(spec)


def from_command_line(model: str, example_inputs: str | None, weights: str | None) -> tuple[Source, Recipe]:
    """``fxquant prepare``: the user names everything, so everything named may be imported and opened. A Hugging
    Face model folder is recorded as ``transformers:<absolute path>``; its example inputs default to
    :data:`DEFAULT_TOKENS` (a causal LM's or text encoder's ``input_ids``)."""
    model = normalize_model_spec(model)
    if example_inputs is None:
        if not is_hf_spec(model):
            raise InputError("--example-inputs is required for a PKG.MODULE:FACTORY model (shapes such as "
                             "1x3x224x224, tokens:1x32 or PKG.MODULE:FUNCTION)")
        example_inputs = DEFAULT_TOKENS
    factory = example_inputs if is_factory(example_inputs) else None
    if weights is None:
        return Source(model, example_inputs), Recipe(model, None, factory, remember=True)
    path = Path(weights)
    if not path.is_file():
        raise InputError(f"--weights {weights!r}: no such file")
    source = Source(model, example_inputs, path.name, sha256_file(path))
    return source, Recipe(model, path.resolve(), factory, remember=True)


def authorize(directory: Path, source: Source, options: TrustOptions, *, inputs_stored: bool) -> Recipe:
    """What a later stage may import and open for ``directory``; raises before anything is imported otherwise."""
    if options.model is not None and normalize_model_spec(options.model) != source.model:
        raise InputError(f"--model {options.model!r} is not the model {directory} was prepared from "
                         f"({source.model!r}); pass --model {source.model}, or prepare a new run for your model")
    trusted = lookup(directory)
    vouched = source.vouched_by(trusted)
    factory = None if inputs_stored or not is_factory(source.example_inputs) else source.example_inputs
    if not vouched and not options.trust_spec:
        if options.model is None:
            raise InputError(_untrusted(directory, source, trusted))
        if factory is not None:
            raise InputError(f"{directory} also names the example-input factory {factory!r}, which --model does "
                             "not cover; pass --trust-model-spec to import it too, or prepare the run again")
    weights = _weights(directory, source, options, trusted if vouched else None)
    if options.trust_spec:
        _announce(directory, source.model, factory, weights)
    remember = options.model is not None or (vouched and options.weights is not None)
    return Recipe(source.model, weights, factory, remember)


def _untrusted(directory: Path, source: Source, trusted: TrustedRun | None) -> str:
    why = ("was not prepared by you here" if trusted is None else
           f"changed since you prepared it here from {trusted.model!r}")
    if source.weights_sha256 is None:
        return (f"{directory} {why}: it names the model {source.model!r}; pass --model {source.model} to import it "
                "(checked against the run), or --trust-model-spec")
    return (f"{directory} {why}: it names the model {source.model!r} with weights {source.weights!r} (SHA-256 "
            f"{source.weights_sha256[:12]}...); pass --model {source.model} --weights FILE to import it (both "
            "checked against the run), or --trust-model-spec --weights FILE")


def _weights(directory: Path, source: Source, options: TrustOptions, trusted: TrustedRun | None) -> Path | None:
    """The weights file to load: the user's ``--weights``, else the trust record's; checked by SHA-256 first."""
    expected = source.weights_sha256
    if expected is None:
        if options.weights is not None:
            raise InputError(f"--weights {options.weights!r}: {directory} was prepared without weights (its factory "
                             "builds them); drop --weights")
        return None
    if options.weights is not None:
        path = Path(options.weights)
        if not path.is_file():
            raise InputError(f"--weights {options.weights!r}: no such file")
        if sha256_file(path) != expected:
            raise InputError(f"--weights {options.weights!r} is not the weights file {directory} was prepared with "
                             f"({source.weights!r}, SHA-256 {expected[:12]}...)")
        return path.resolve()
    if trusted is None or trusted.weights is None:
        raise InputError(f"{directory} was prepared with the weights file {source.weights!r} (SHA-256 "
                         f"{expected[:12]}...); pass it with --weights FILE")
    path = Path(trusted.weights)
    if not path.is_file():
        raise InputError(f"the weights file {path} recorded by `fxquant prepare` is missing; restore it or pass "
                         "--weights FILE")
    if sha256_file(path) != expected:
        raise ArtifactError(f"the weights file {path} changed since `fxquant prepare` (SHA-256 mismatch); pass the "
                            "original with --weights FILE, or prepare a new run for the new weights")
    return path


def _announce(directory: Path, model: str, factory: str | None, weights: Path | None) -> None:
    """``--trust-model-spec``: say exactly what will be imported and called, before doing it (rank 0 only)."""
    if os.environ.get("RANK", "0") != "0":
        return
    where = directory / MANIFEST_NAME
    if is_hf_spec(model):
        print(f"fxquant: --trust-model-spec: loading the Hugging Face model {model[len('transformers:'):]!r} named "
              f"by {where} (weights and config only: trust_remote_code stays off)", file=sys.stderr)
    factories = (("model factory", None if is_hf_spec(model) else model), ("example-input factory", factory))
    for what, spec in factories:
        if spec is not None:
            module, _, name = spec.partition(":")
            print(f"fxquant: --trust-model-spec: importing module {module!r} ({_origin(module)}) and calling "
                  f"{name}(), the {what} named by {where}", file=sys.stderr)
    if weights is not None:
        print(f"fxquant: --trust-model-spec: then loading the weights {weights} (torch.load weights_only)",
              file=sys.stderr)


def _origin(module: str) -> str:
    """Where ``import module`` would load it from, found without running its code or its packages'."""
    path: list[str] | None = None
    spec = None
    parts = module.split(".")
    for index in range(len(parts)):
        name = ".".join(parts[:index + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            if index == len(parts) - 1:
                return f"already imported from {getattr(loaded, '__file__', None) or 'a built-in'}"
            path = list(getattr(loaded, "__path__", []))
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return "found by an import hook, or not at all"
        path = list(spec.submodule_search_locations or [])
    return f"from {spec.origin}" if spec is not None and spec.origin else "a namespace package"


def trust_status(directory: Path, source: Source) -> str:
    """For ``fxquant inspect``: may later stages import this run's model without being told again?"""
    if source.vouched_by(lookup(directory)):
        return f"yes: you prepared it here (trust record {trust_file()})"
    weights = " --weights FILE" if source.weights_sha256 else ""
    return f"no: later stages need --model {source.model}{weights}, or --trust-model-spec"

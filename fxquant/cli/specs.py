"""Parse the command line's references to user code and shapes: ``PKG.MODULE:NAME`` and ``1x3x224x224,1x10``."""

from __future__ import annotations

import importlib
import re
from typing import Any

import torch
from torch import nn

from fxquant.cli.hf import is_hf_spec, load_hf_model, vocabulary_size
from fxquant.errors import InputError

_SHAPE = re.compile(r"^\d+(x\d+)*$")
TOKENS = re.compile(r"^tokens:(\d+)x(\d+)$")  # ``tokens:BxT``: random token ids of the model's vocabulary


def load_object(spec: str, what: str) -> Any:
    """Import ``PKG.MODULE:NAME`` and return the attribute; errors say which part is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(f"{what} {spec!r} must look like PKG.MODULE:NAME (e.g. fxquant.models:mlp)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"{what} {spec!r}: cannot import module {module_name!r} ({exc}); check the name and that "
                         "it is importable from the current directory / PYTHONPATH") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise InputError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def call_object(spec: str, what: str) -> Any:
    """Import ``PKG.MODULE:NAME`` and call it with no arguments; its exceptions become one-line ``InputError``."""
    fn = load_object(spec, what)
    if not callable(fn):
        raise InputError(f"{what} {spec!r} is not callable")
    try:
        return fn()
    except Exception as exc:
        raise InputError(f"{what} {spec!r} raised {type(exc).__name__}: {exc}") from exc


def build_model(spec: str, weights: str | None = None) -> nn.Module:
    """Call the factory ``spec``, optionally load a state dict (``weights_only``), and put it in eval mode.

    The factory runs with torch's RNG seeded (and the caller's RNG state restored afterwards): every stage of a run
    rebuilds the model, and a randomly initialised model must come out the same each time.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = load_hf_model(spec) if is_hf_spec(spec) else call_object(spec, "--model")
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    if weights is not None:
        from fxquant.serialization import load_tensors

        try:
            model.load_state_dict(load_tensors(weights))
        except RuntimeError as exc:
            detail = " ".join(line.strip() for line in str(exc).splitlines()[1:] if line.strip())
            raise InputError(f"--weights {weights!r} does not fit {spec!r}: {detail[:300]}") from None
    return model.eval()


def parse_example_inputs(spec: str, model: nn.Module | None = None) -> tuple[Any, ...]:
    """``1x3x224x224,1x10`` -> random float tensors of those shapes; ``tokens:BxT`` -> a B x T int64 tensor of
    random ids below ``model``'s vocabulary size (seeded, like the shapes); ``PKG.MODULE:FUNCTION`` -> its tuple."""
    tokens = TOKENS.match(spec)
    if tokens is not None:
        if model is None:
            raise InputError(f"--example-inputs {spec!r} needs the model to know its vocabulary size")
        shape = (int(tokens[1]), int(tokens[2]))
        if 0 in shape:
            raise InputError(f"--example-inputs {spec!r}: a batch needs at least one row of one token")
        return (torch.randint(vocabulary_size(model), shape, generator=torch.Generator().manual_seed(0)),)
    if ":" in spec:
        value = call_object(spec, "--example-inputs")
        return tuple(value) if isinstance(value, (tuple, list)) else (value,)
    shapes = [s.strip() for s in spec.split(",")]
    bad = [s for s in shapes if not _SHAPE.match(s)]
    if bad:
        raise InputError(f"--example-inputs {spec!r}: {bad[0]!r} is not a shape like 1x3x224x224 "
                         "(comma-separate several inputs, or give PKG.MODULE:FUNCTION)")
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(*map(int, s.split("x")), generator=generator) for s in shapes)


def metric_spec(name: str) -> Any:
    """``--metric``: a built-in metric name (``top1``, ``top5``) as is, or the callable ``PKG.MODULE:FUNCTION``."""
    if ":" not in name:
        return name
    metric = load_object(name, "--metric")
    if not callable(metric):
        raise InputError(f"--metric {name!r} is not callable")
    return metric

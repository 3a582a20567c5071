"""``fxquant.export(qmodel, "x.pt2")``: a ``torch.export`` program of the reference backend's arithmetic on the
model's own qparams, so ``torch.export.load(path).module()(x)`` is, bit for bit, ``fxquant.convert(prepared,
backend="reference")(x)`` for a reference model, and the eager model re-lowered onto the reference backend for a
onednn one (the same qparams where the CPU has VNNI; 7-bit activations without it), at batch sizes other than the
exported one, and in a process where fxquant cannot even be imported."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.models import create_model
from fxquant.testing import relowered

EXPORT_BATCH = 2
# Small zoo variants (tests/test_zoo_quantization.py's): the property is exactness, which size does not change
ZOO = {
    "mlp": ({}, (1024,)),
    "resnet18": ({"num_classes": 10, "residual_gamma": 0.25}, (3, 64, 64)),
    "mobilenetv2": ({"num_classes": 10, "settings": ((1, 16, 1, 1), (6, 24, 2, 2))}, (3, 64, 64)),
    "digits_cnn": ({}, (1, 8, 8)),
}
HEAVY = {"resnet18", "mobilenetv2"}  # 5-10 s each to build and export: -m slow
BACKENDS = [b for b in ("onednn", "reference") if b in available_backends()]


def _marks(name: str, batch: int) -> list[pytest.MarkDecorator]:
    return [pytest.mark.slow] if name in HEAVY else []


def _params() -> list[Any]:
    return [pytest.param(name, backend, batch, marks=_marks(name, batch))
            for name in ZOO for backend in BACKENDS for batch in (1, 3, 7)]


def _samples(name: str, batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, *ZOO[name][1], generator=torch.Generator().manual_seed(seed))


def _calibrated(name: str) -> fx.GraphModule:
    torch.manual_seed(0)
    options, _ = ZOO[name]
    data = [_samples(name, 4, seed) for seed in range(5)]
    prepared = fxquant.prepare(create_model(name, **options), (data[0][:EXPORT_BATCH],))
    fxquant.calibrate(prepared, data, progress=False)
    return prepared


def _only_tensor(output: Any) -> torch.Tensor:
    """The one tensor of a program's output: a flat tuple of tensors (docs/export.md)."""
    assert isinstance(output, tuple) and len(output) == 1, f"expected a 1-tuple, got {type(output).__name__}"
    return output[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, nn.Module, nn.Module]]:
    """(model, backend) -> (the .pt2 of the model converted for backend, its loaded program, the reference backend's
    model)."""
    root = tmp_path_factory.mktemp("pt2")

    @functools.cache
    def calibrated(name: str) -> tuple[fx.GraphModule, nn.Module]:
        prepared = _calibrated(name)
        return prepared, fxquant.convert(prepared, backend="reference")

    @functools.cache
    def build(name: str, backend: str) -> tuple[Path, nn.Module, nn.Module]:
        prepared, reference = calibrated(name)
        qmodel = fxquant.convert(prepared, backend=backend)
        path = fxquant.export(qmodel, root / f"{name}-{backend}.pt2")
        return path, torch.export.load(str(path)).module(), reference if backend == "reference" else \
            relowered(qmodel, "reference")

    return build


@pytest.mark.parametrize(("name", "backend", "batch"), _params())
def test_program_is_the_reference_backend_bit_for_bit(name: str, backend: str, batch: int,
                                                      exported: Callable[..., Any]) -> None:
    _, program, reference = exported(name, backend)
    x = _samples(name, batch, seed=100 + batch)
    with torch.inference_mode():
        got, expected = _only_tensor(program(x)), reference(x)
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"{name} ({backend}) at batch {batch}: max |diff| {(got - expected).abs().max()}"


def test_program_returns_a_flat_tuple_of_tensors(exported: Callable[..., Any]) -> None:
    """docs/export.md: "every model's outputs as a flat tuple of tensors" (one tensor here: a 1-tuple)."""
    _, program, reference = exported("mlp", BACKENDS[0])
    x = _samples("mlp", 3, seed=7)
    got = program(x)
    assert isinstance(got, tuple) and len(got) == 1, f"expected a 1-tuple, got {type(got).__name__}"
    assert torch.equal(got[0], reference(x))


_WITHOUT_FXQUANT = """
import importlib.util
import sys

assert importlib.util.find_spec("fxquant") is not None, "fxquant is not installed here: blocking it proves nothing"


class _NoFxquant:
    def find_spec(self, name, path=None, target=None):
        if name == "fxquant" or name.startswith("fxquant."):
            raise ImportError(f"{name}: an export must load without fxquant")
        return None


sys.meta_path.insert(0, _NoFxquant())
try:
    import fxquant
except ImportError:
    pass
else:
    raise AssertionError("the import blocker let fxquant through")
import torch

cases = torch.load(sys.argv[1], weights_only=True)
torch.save({name: torch.export.load(path).module()(x) for name, (path, x) in cases.items()}, sys.argv[2])
assert not [m for m in sys.modules if m == "fxquant" or m.startswith("fxquant.")], "fxquant was imported"
"""


@pytest.mark.parametrize("names", [pytest.param(sorted(set(ZOO) - HEAVY), id="light"),
                                   pytest.param(sorted(HEAVY), id="heavy", marks=pytest.mark.slow)])
def test_programs_load_and_run_where_fxquant_cannot_be_imported(names: list[str], exported: Callable[..., Any],
                                                                tmp_path: Path) -> None:
    """One fresh process for several files (torch's start-up is most of its cost), at a batch size other than the
    exported one; the files of models converted for onednn (the default backend), whose kernels fxquant runs
    itself."""
    cases = {name: (str(exported(name, BACKENDS[0])[0]), _samples(name, EXPORT_BATCH + 3, seed=9)) for name in names}
    torch.save(cases, tmp_path / "inputs.pt")
    fresh = subprocess.run([sys.executable, "-c", _WITHOUT_FXQUANT, str(tmp_path / "inputs.pt"),
                            str(tmp_path / "outputs.pt")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
    for name, (_, x) in cases.items():
        with torch.inference_mode():
            expected = exported(name, BACKENDS[0])[2](x)
        got = _only_tensor(outputs[name])
        assert torch.equal(got, expected), f"{name}: max |diff| {(got - expected).abs().max()}"

"""Shared pieces of the ``scripts/`` benchmarks: the ways to run a model (FP32, fxquant, peers) and what they report.

A *candidate* is one way to run a model: a label, a callable on the inputs, and the quantize/dequantize node counts of
its graph. A *peer* is another INT8 toolchain measured next to fxquant; each is a :class:`Peer` subclass registered
with :func:`register_peer`. A peer whose packages are missing is skipped with a note, so adding torchao PT2E or ONNX
Runtime later is one subclass with ``requires = ("torchao",)`` / ``("onnxruntime",)`` and a ``build`` method; the
tables gain its columns without other changes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import platform
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import fx, nn

import fxquant
from fxquant.cpu import cpu_model, isa_summary
from fxquant.kernels.quantized_engine import quantized_engine
from fxquant.models import create_model, example_inputs
from fxquant.nn import DeQuantize, Quantize


@dataclass(frozen=True)
class QdqCount:
    """How many quantize and dequantize nodes a converted graph has (each is a float<->int8 round trip)."""

    quantize: int
    dequantize: int


@dataclass
class Candidate:
    """One way to run a model: ``run(*inputs)``, labelled for the tables, with its graph's Q/DQ count."""

    label: str
    run: Callable[..., Any]
    qdq: QdqCount | None = None


@dataclass(frozen=True)
class Workload:
    """A float model and the calibration batches every toolchain sees (the same tensors for all of them)."""

    name: str
    model: nn.Module
    example: tuple[torch.Tensor, ...]
    calibration: tuple[tuple[torch.Tensor, ...], ...]


def make_workload(name: str, *, batches: int, batch_size: int) -> Workload:
    """The zoo model ``name`` plus ``batches`` seeded random batches from its example-input distribution.

    Seed 0 is left for the timed inputs, so calibration never sees the exact tensors that are measured.
    """
    calibration = tuple(example_inputs(name, batch_size, seed=seed) for seed in range(1, batches + 1))
    return Workload(name, create_model(name), example_inputs(name, 1), calibration)


def count_fxquant_qdq(gm: fx.GraphModule) -> QdqCount:
    modules = dict(gm.named_modules())
    kinds = [type(modules.get(str(node.target))) for node in gm.graph.nodes if node.op == "call_module"]
    return QdqCount(kinds.count(Quantize), kinds.count(DeQuantize))


def count_torch_ao_qdq(gm: fx.GraphModule) -> QdqCount:
    nodes = list(gm.graph.nodes)
    quantize = sum(n.op == "call_function" and n.target is torch.quantize_per_tensor for n in nodes)
    dequantize = sum(n.op == "call_method" and n.target == "dequantize" for n in nodes)
    return QdqCount(quantize, dequantize)


def fp32_candidate(workload: Workload) -> Candidate:
    return Candidate("FP32", workload.model)


def fxquant_calibrated(workload: Workload, backend: str) -> fx.GraphModule:
    """``prepare`` + ``calibrate``; qparams are backend-independent, so one calibration serves every backend."""
    prepared = fxquant.prepare(workload.model, workload.example, fxquant.QuantConfig(backend=backend))
    fxquant.calibrate(prepared, list(workload.calibration), progress=False)
    return prepared


def fxquant_candidate(prepared: fx.GraphModule, backend: str) -> Candidate:
    qmodel = fxquant.convert(prepared, backend=backend)
    return Candidate(f"fxquant[{backend}]", qmodel, count_fxquant_qdq(qmodel))


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB (inf when equal)."""
    noise = (reference.float() - actual.float()).pow(2).sum().item()
    signal = reference.float().pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


class Peer(ABC):
    """Another INT8 toolchain, built from the same float model and calibration batches as fxquant."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()  # importable modules the peer needs

    def unavailable_reason(self, engine: str) -> str | None:
        """Why the peer cannot run here (a missing package, an unsupported engine), or None when it can."""
        missing = [module for module in self.requires if not _importable(module)]
        return f"{', '.join(missing)} not installed" if missing else None

    @abstractmethod
    def build(self, workload: Workload, engine: str) -> Candidate: ...


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


PEERS: dict[str, Peer] = {}
P = TypeVar("P", bound=type[Peer])


def register_peer(cls: P) -> P:
    if cls.name in PEERS:
        raise ValueError(f"a peer named {cls.name!r} is already registered")
    PEERS[cls.name] = cls()
    return cls


@contextlib.contextmanager
def _quiet_torch_deprecations() -> Iterator[None]:
    """torch.ao's FX quantization warns on every call that it is deprecated; the benchmark knows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=r".*(reduce_range|quantized tensor creation).*")
        yield


@register_peer
class TorchAoFx(Peer):
    """``torch.ao.quantization.quantize_fx`` with the engine's default qconfig mapping.

    The global quantized engine is set while preparing, converting and on every call, and restored each time, so
    the fxquant rows measured interleaved with it run under the process default as a user's code would.
    """

    name = "torch_ao_fx"
    label = "torch.ao FX"
    requires = ("torch.ao.quantization.quantize_fx",)

    def unavailable_reason(self, engine: str) -> str | None:
        if engine not in torch.backends.quantized.supported_engines:
            return f"engine {engine!r} not in this torch build"
        return super().unavailable_reason(engine)

    def build(self, workload: Workload, engine: str) -> Candidate:
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        with _quiet_torch_deprecations(), quantized_engine(engine), torch.no_grad():
            prepared = prepare_fx(copy.deepcopy(workload.model), get_default_qconfig_mapping(engine),
                                  workload.example)
            for batch in workload.calibration:
                prepared(*batch)
            qmodel = convert_fx(prepared)

        def run(*inputs: torch.Tensor) -> Any:
            with quantized_engine(engine):
                return qmodel(*inputs)

        return Candidate(self.label, run, count_torch_ao_qdq(qmodel))


def environment_lines() -> list[str]:
    """What a reader needs to compare two benchmark runs: CPU, its int8 ISA, versions, thread defaults."""
    isa = ", ".join(name for name, present in isa_summary().items() if present) or "none of avx512f/vnni/amx"
    return [
        f"CPU: {cpu_model()} ({isa}); torch sees {torch.get_num_threads()} threads",
        f"torch {torch.__version__}, fxquant {fxquant.__version__}, python {platform.python_version()}; "
        f"default quantized engine {torch.backends.quantized.engine!r}",
        load_average(),
    ]


def busy_note(peak_load: float) -> str | None:
    """A warning for the notes when the 1-minute load went above the logical CPUs during the run, else None."""
    cpus = os.cpu_count() or 1
    if peak_load <= cpus:
        return None
    return (f"the 1-minute load average reached {peak_load:.1f} on {cpus} logical CPUs: other processes shared the "
            "timed cores; rows with more threads are the least reliable (a multi-threaded op waits for its slowest, "
            "possibly preempted, thread)")


def load_1min() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def load_average() -> str:
    """The machine's 1/5/15-minute load: above the core count, other processes share the timed cores."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average: unknown"
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min) on {os.cpu_count()} logical CPUs"

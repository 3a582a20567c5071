"""Shared pieces of the ``scripts/`` benchmarks: the ways to run a model (FP32, fxquant, peers) and what they report.

A *candidate* is one way to run a model: a label, a callable on the inputs, and the quantize/dequantize node counts of
its graph. A *peer* is another INT8 toolchain measured next to fxquant; each is a :class:`Peer` subclass registered
with :func:`register_peer` in a ``_peers_*.py`` module (torch.ao FX per engine, torchao PT2E + Inductor, ONNX
Runtime), loaded by :func:`load_peers`. A peer whose packages are missing is skipped with a note; the tables gain its
columns without other changes. A :class:`Suite` collects one run (latency, Q/DQ counts, SQNR, what could not run) and
renders the markdown tables of ``benchmark.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import platform
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import fx, nn

import fxquant
from fxquant.models import create_model, example_inputs
from fxquant.native.isa import cpu_model, isa_summary
from fxquant.report.latency import LatencyStats
from fxquant.runtime.auto_backend import FAMILIES


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
    note: str = ""  # how it was built, when a reader of the tables should know (e.g. a workaround)
    lazy: bool = False  # its first call at a new shape or thread count builds something (a compile, a session)
    model: fx.GraphModule | None = None  # fxquant's converted model, to tell two candidates that execute the same


@dataclass(frozen=True)
class Workload:
    """A float model and the calibration batches every toolchain sees (the same tensors for all of them).

    ``config`` holds extra ``fxquant.QuantConfig`` options the model needs (and that a user would be told to set).
    """

    name: str
    model: nn.Module
    example: tuple[torch.Tensor, ...]
    calibration: tuple[tuple[torch.Tensor, ...], ...]
    config: dict[str, Any] = field(default_factory=dict)


def make_workload(name: str, *, batches: int, batch_size: int, config: dict[str, Any] | None = None) -> Workload:
    """The zoo model ``name`` plus ``batches`` seeded random batches from its example-input distribution.

    Seed 0 is left for the timed inputs, so calibration never sees the exact tensors that are measured.
    """
    calibration = tuple(example_inputs(name, batch_size, seed=seed) for seed in range(1, batches + 1))
    return Workload(name, create_model(name), example_inputs(name, 1), calibration, dict(config or {}))


def count_fxquant_qdq(gm: fx.GraphModule) -> QdqCount:
    """Quantize/dequantize nodes of the converted model, including those inside INT8 islands of untraceable blocks."""
    report = fxquant.coverage(gm)
    return QdqCount(report.quantize_nodes, report.dequantize_nodes)


def count_torch_ao_qdq(gm: fx.GraphModule) -> QdqCount:
    nodes = list(gm.graph.nodes)
    quantize = sum(n.op == "call_function" and n.target is torch.quantize_per_tensor for n in nodes)
    dequantize = sum(n.op == "call_method" and n.target == "dequantize" for n in nodes)
    return QdqCount(quantize, dequantize)


def fp32_candidate(workload: Workload) -> Candidate:
    return Candidate("FP32", workload.model)


def fxquant_calibrated(workload: Workload, backend: str) -> fx.GraphModule:
    """``prepare`` + ``calibrate``; qparams are backend-independent, so one calibration serves every backend."""
    prepared = fxquant.prepare(workload.model, workload.example,
                               fxquant.QuantConfig(backend=backend, **workload.config))
    fxquant.calibrate(prepared, list(workload.calibration), progress=False)
    return prepared


def fxquant_candidate(prepared: fx.GraphModule, backend: str, timing: tuple[torch.Tensor, ...] | None = None
                      ) -> Candidate:
    """``timing``: the inputs ``backend="auto"`` measures kernels on (its deployment batch); None for the others."""
    qmodel = fxquant.convert(prepared, backend=backend, example_inputs=timing)
    return Candidate(f"fxquant[{backend}]", qmodel, count_fxquant_qdq(qmodel), model=qmodel)


def executed_model(gm: fx.GraphModule) -> tuple[Any, ...]:
    """What runs: every node (op, target or module class) and every Linear/Conv's backend.

    Two fxquant models with equal signatures run the same graph with the same layer kernels (``auto`` whose every
    layer took one backend's kernel is that backend's model), so a benchmark times them once. Non-layer modules
    (quantize, add, pool) count by their backend's family (``fxquant.runtime.auto_backend.FAMILIES``, one activation
    representation):
    ``auto`` lowers them with the family's first member, and within a family they run the same torch ops.
    """
    def family(module: nn.Module) -> str:
        name = getattr(getattr(module, "backend", None), "name", "")
        return next(("+".join(f) for f in FAMILIES if name in f), name)

    def target(node: fx.Node) -> tuple[str, ...]:
        if node.op != "call_module":
            return (node.op, str(getattr(node.target, "__name__", node.target)))
        module = gm.get_submodule(str(node.target))
        return (node.op, type(module).__name__, family(module))

    layers = tuple((r.path, r.kind, r.quantized, r.backend) for r in fxquant.coverage(gm).layers)
    return tuple(target(node) for node in gm.graph.nodes), layers


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

    def unavailable_reason(self) -> str | None:
        """Why the peer cannot run here (a missing package, an unsupported engine), or None when it can."""
        missing = [module for module in self.requires if not _importable(module)]
        return f"{', '.join(missing)} not installed" if missing else None

    @abstractmethod
    def build(self, workload: Workload) -> Candidate: ...


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


FP32 = "fp32"
Where = tuple[str, int, int]  # model, batch, threads
PEER_MODULES = ("_peers_torch_ao", "_peers_pt2e", "_peers_ort")


def load_peers() -> dict[str, Peer]:
    """Import the ``_peers_*`` modules (each registers its peers; none imports an optional package until ``build``)."""
    for module in PEER_MODULES:
        importlib.import_module(module)
    return PEERS


@contextlib.contextmanager
def _quiet_torch_deprecations() -> Iterator[None]:
    """torch.ao's FX quantization warns on every call that it is deprecated; the benchmark knows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message=r".*(reduce_range|quantized tensor creation).*")
        yield


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


@dataclass
class Suite:
    """What one run collects, keyed by model and candidate key (``fp32``, ``fxquant:<backend>``, a peer name)."""

    rows: list[tuple[Where, dict[str, LatencyStats]]] = field(default_factory=list)
    qdq: dict[tuple[str, str], QdqCount] = field(default_factory=dict)
    sqnr: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)  # at the largest batch timed
    missing: dict[tuple[str, str], str] = field(default_factory=dict)  # could not be built: 'n/a' cells
    same: dict[tuple[str, str], str] = field(default_factory=dict)  # (model, key) -> the key it executes as
    peak: list[str] = field(default_factory=list)  # fraction of the CPU's INT8 peak, one line per row measured
    slow: dict[tuple[str, int, int, str], float | None] = field(default_factory=dict)  # ms of one call, or not run
    profiles: list[tuple[str, int, int, str, list[tuple[str, float, int]]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    start_load: str = field(default_factory=load_average)
    peak_load: float = 0.0  # highest 1-minute load average seen after a configuration

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            print(f"note: {text}", file=sys.stderr, flush=True)

    def unavailable(self, model: str, key: str, reason: str) -> None:
        self.missing[(model, key)] = reason
        self.note(reason)

    def record_sqnr(self, model: str, key: str, batch: int, value: float) -> None:
        if batch >= self.sqnr.get((model, key), (0, 0.0))[0]:
            self.sqnr[(model, key)] = (batch, value)

    def record(self, where: Where, stats: dict[str, LatencyStats]) -> None:
        self.rows.append((where, stats))
        print(f"{where[0]} batch={where[1]} threads={where[2]}: "
              + "; ".join(f"{label(k)} {_ms(s)}" for k, s in stats.items()), flush=True)




def label(key: str) -> str:
    if key == FP32:
        return "FP32"
    if key.startswith("fxquant:"):
        return f"fxquant[{key.split(':', 1)[1]}]"
    return PEERS[key].label


def _fmt(ms: float) -> str:
    return f"{ms:.{3 if ms < 1 else 2 if ms < 100 else 0}f}"


def _ms(stats: LatencyStats) -> str:
    return _fmt(stats.median)


def _ms_range(stats: LatencyStats) -> str:
    """The median with the fastest and slowest timed call: ``4.32 [4.20-5.10]``."""
    return f"{_ms(stats)} [{_fmt(stats.min)}-{_fmt(stats.max)}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _cell(suite: Suite, where: Where, key: str, stats: dict[str, LatencyStats]) -> str:
    if key in stats:
        return _ms_range(stats[key])
    if (where[0], key) in suite.same:
        return f"= {label(suite.same[(where[0], key)])}"
    if (*where, key) in suite.slow:
        ms = suite.slow[(*where, key)]
        return f"~{ms:.0f}" if ms else "skipped"
    return "n/a" if (where[0], key) in suite.missing else "-"


def _keys(suite: Suite, prefix: bool) -> list[str]:
    seen = dict.fromkeys(k for _, stats in suite.rows for k in stats)
    seen.update(dict.fromkeys(k for (_, k) in suite.missing))
    seen.update(dict.fromkeys(k for (_, k) in suite.same))
    seen.update(dict.fromkeys(k[3] for k in suite.slow))
    return [k for k in seen if k != FP32 and k.startswith("fxquant:") == prefix]


def _ratio(stats: dict[str, LatencyStats], ours: str | None, theirs: str) -> str:
    return f" ({stats[ours].median / stats[theirs].median:.2f})" if ours and theirs in stats else ""


def latency_table(suite: Suite, models: Sequence[str]) -> list[str]:
    """The peer matrix: every candidate's median per configuration; a peer's cell adds (fastest fxquant / peer)."""
    fxq, peers = _keys(suite, True), [k for k in _keys(suite, False) if k in PEERS]
    rows = []
    for where, stats in (r for r in suite.rows if r[0][0] in models):
        best = min((k for k in fxq if k in stats), key=lambda k: stats[k].median, default=None)
        best_peer = min((k for k in peers if k in stats), key=lambda k: stats[k].median, default=None)
        rows.append([*map(str, where), _ms_range(stats[FP32]), *(_cell(suite, where, k, stats) for k in fxq),
                     *(_cell(suite, where, k, stats) + _ratio(stats, best, k) for k in peers),
                     f"{label(best)} {_ms(stats[best])}" if best else "-",
                     f"{label(best_peer)} {_ms(stats[best_peer])}" if best_peer else "-",
                     f"{stats[best].median / stats[best_peer].median:.2f}" if best and best_peer else "-"])
    return _table(["model", "batch", "threads", "FP32 ms", *(f"{label(k)} ms" for k in fxq),
                   *(f"{label(k)} ms (fxq/peer)" for k in peers), "fastest fxquant", "fastest peer",
                   "fastest fxquant / fastest peer"], rows)


def zoo_tables(suite: Suite, engines: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """The same-engine comparison: fxquant / torch.ao FX latency per shared engine, Q/DQ counts and SQNR per model;
    and the misses of its targets (slower than torch.ao FX, or more Q/DQ nodes)."""
    rows, misses = [], []
    for where, stats in suite.rows:
        cells = []
        for engine in engines:
            fxq, peer = f"fxquant:{engine}", f"torch.ao:{engine}"
            if fxq in stats and peer in stats:
                ratio = stats[fxq].median / stats[peer].median
                cells.append(f"{ratio:.2f} ({_ms_range(stats[fxq])} / {_ms_range(stats[peer])})"
                             + (" MISS" if ratio > 1 else ""))
                if ratio > 1:
                    misses.append(f"latency: {where[0]} batch {where[1]} threads {where[2]} {engine}: {ratio:.2f}")
            else:
                cells.append(_cell(suite, where, peer if fxq in stats else fxq, stats))
        rows.append([*map(str, where), *cells])
    graph = []
    for model in dict.fromkeys(where[0] for where, _ in suite.rows):
        for engine in engines:
            ours, theirs = suite.qdq.get((model, f"fxquant:{engine}")), suite.qdq.get((model, f"torch.ao:{engine}"))
            if ours is None:
                continue
            total = ours.quantize + ours.dequantize
            their_total = theirs.quantize + theirs.dequantize if theirs else None
            if their_total is not None and total > their_total:
                misses.append(f"Q/DQ nodes: {model} {engine}: {total} > {their_total}")
            graph.append([model, engine, f"{ours.quantize}+{ours.dequantize}",
                          f"{theirs.quantize}+{theirs.dequantize}" if theirs else "n/a",
                          *(_sqnr(suite, model, k) for k in (f"fxquant:{engine}", f"torch.ao:{engine}"))])
    header = [f"{e}: fxquant/torch.ao (ms [min-max] / ms [min-max])" for e in engines]
    return (_table(["model", "batch", "threads", *header], rows),
            _table(["model", "engine", "fxquant Q+DQ nodes", "torch.ao Q+DQ nodes", "fxquant SQNR dB",
                    "torch.ao SQNR dB"], graph), misses)


def _sqnr(suite: Suite, model: str, key: str) -> str:
    if (model, key) not in suite.sqnr:
        return "n/a" if (model, key) in suite.missing else "-"
    batch, value = suite.sqnr[(model, key)]
    return f"{value:.1f} (b{batch})"


def sqnr_table(suite: Suite) -> list[str]:
    keys = [*_keys(suite, True), *_keys(suite, False)]
    models = dict.fromkeys(where[0] for where, _ in suite.rows)
    return _table(["model", *(label(k) for k in keys)], [[m, *(_sqnr(suite, m, k) for k in keys)] for m in models])


def profile_lines(suite: Suite) -> list[str]:
    lines = []
    for model, batch, threads, who, ops in suite.profiles:
        how = "node wall ms per call (fx.Interpreter walk)" if who.startswith("fxquant") else "self CPU ms per call"
        lines += ["", f"{model} batch {batch} threads {threads}, {who}: {how}", "",
                  *_table(["op", "ms", "calls"], [[op, f"{ms:.3f}", str(n)] for op, ms, n in ops])]
    return lines

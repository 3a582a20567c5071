"""Where a candidate's time goes: ``torch.profiler`` ops, or for fxquant models the time of each graph node.

fxquant's oneDNN primitives and C loops are called from its own extension, not as torch ops, so the profiler sees
an fxquant model as one long gap between ops. Its layers are timed node by node instead, in an ``fx.Interpreter``
walk (which skips the graph runner's fused steps, so the walk's total is a little above a real call's; SDPA nodes
run the attention the graph runner gives them, :mod:`fxquant.runtime.attention`). ONNX
Runtime's kernels are invisible to torch.profiler too: :func:`ort_ops` reads ORT's own profile, op type by op type.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from _bench_common import Candidate
from _peers_ort import OrtSessions, session_options
from torch import fx

from fxquant.report.latency import num_threads
from fxquant.runtime import attention

BETWEEN_OPS = "(between ops)"
Row = tuple[str, float, int]  # what, ms per call, calls per call


def top_ops(candidate: Candidate, inputs: tuple[torch.Tensor, ...], *, threads: int, runs: int = 3,
            rows: int = 10) -> list[Row]:
    """The ``rows`` biggest costs of one call: node times for an fxquant model, else profiler self CPU time.

    Under the profiler each call runs inside a ``record_function`` scope whose *self* time is everything between the
    ops: Python, module dispatch, allocation. It is listed as ``(between ops)``.
    """
    with num_threads(threads), torch.inference_mode():
        candidate.run(*inputs)
        if candidate.model is not None:
            return node_times(candidate.model, inputs, runs=runs, rows=rows)
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(runs):
                with record_function(BETWEEN_OPS):
                    candidate.run(*inputs)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    return [(e.key, e.self_cpu_time_total / 1e3 / runs, e.count // runs) for e in events]


class _NodeTimer(fx.Interpreter):
    """Adds each call_module/call_function node's wall time to ``times`` under a name saying what ran."""

    def __init__(self, gm: fx.GraphModule, times: dict[str, list[float]]) -> None:
        super().__init__(gm)
        self.times = times
        self.fast_attention = attention.runs_fast(gm)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.fast_attention and target in attention.SDPA:  # as the graph runner calls it
            target = attention.scaled_dot_product_attention
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_module", "call_function", "call_method"):
            return super().run_node(n)
        start = time.perf_counter()
        out = super().run_node(n)
        self.times[self._name(n)].append((time.perf_counter() - start) * 1e3)
        return out

    def _name(self, n: fx.Node) -> str:
        if n.op != "call_module":
            return f"{n.op} {getattr(n.target, '__name__', n.target)}"
        module = self.module.get_submodule(str(n.target))
        backend = getattr(getattr(module, "backend", None), "name", "")
        return f"{type(module).__name__}{f'[{backend}]' if backend else ''} {n.target}"


def node_times(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], *, runs: int, rows: int) -> list[Row]:
    """Per module class (``all ...``), then the slowest single nodes: ms per call, nodes per call."""
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(runs):
        _NodeTimer(gm, times).run(*inputs)
    per_class: dict[str, list[float]] = defaultdict(list)
    for name, samples in times.items():
        per_class[f"all {name.split(' ')[0]}" if name.startswith("Quantized") else name].extend(samples)
    classes = sorted(((k, sum(v) / runs, len(v) // runs) for k, v in per_class.items()), key=lambda r: -r[1])
    layers = sorted(((k, sum(v) / runs, 1) for k, v in times.items() if k.startswith("Quantized")),
                    key=lambda r: -r[1])
    return classes[: rows // 2] + layers[: rows - min(len(classes), rows // 2)]


def ort_ops(sessions: OrtSessions, inputs: tuple[torch.Tensor, ...], *, threads: int, runs: int = 5) -> list[Row]:
    """Every op type ONNX Runtime ran after its graph optimisations (``QLinearConv``, ``QGemm``, a float
    ``Conv`` that no fusion took, ...): kernel ms per call and nodes per call, slowest first. The first call
    (allocations) is left out."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = session_options(threads, profile_prefix=str(Path(tmp, "ort")))
        session = ort.InferenceSession(sessions.model_bytes, options, providers=["CPUExecutionProvider"])
        for _ in range(runs + 1):
            session.run(None, sessions.feed(inputs))
        events = json.loads(Path(session.end_profiling()).read_text())
    first = min((e for e in events if e["name"] == "model_run"), key=lambda e: e["ts"])
    times: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") \
                and event["ts"] >= first["ts"] + first["dur"]:
            times[event["args"]["op_name"]].append(event["dur"] / 1e3)
    return sorted(((op, sum(v) / runs, len(v) // runs) for op, v in times.items()), key=lambda r: -r[1])

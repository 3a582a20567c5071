"""Latency of fxquant INT8 against FP32 and peer INT8 toolchains, with a markdown table for issue notes.

Every row of one configuration (model, batch, threads, engine) is timed interleaved in one
:func:`fxquant.report.latency.measure_latency` run, so the ratios survive a shared, noisy machine. All INT8 models
are calibrated on the same seeded random batches. Ratios: ``FP32/fxquant`` is fxquant's speedup over float;
``<peer>/fxquant`` >= 1.0 means fxquant is no slower than the peer.

    python scripts/benchmark.py                     # the default run: ~4-5 minutes on 2 cores
    python scripts/benchmark.py --quick             # smoke run: tiny time budget
    python scripts/benchmark.py --models mlp --batches 1 --threads 1 --engine all --backends all
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from _bench_common import (
    PEERS,
    Candidate,
    Workload,
    busy_note,
    environment_lines,
    fp32_candidate,
    fxquant_calibrated,
    fxquant_candidate,
    load_1min,
    load_average,
    make_workload,
    sqnr_db,
)

from fxquant.errors import FxQuantError
from fxquant.kernels.registry import available_backends
from fxquant.models import UNTRACEABLE, ZOO, example_inputs
from fxquant.report.latency import LatencyStats, measure_latency, num_threads

ENGINES = ("fbgemm", "qnnpack")
HEAVY_CALL_S = 0.25  # a config whose slowest call takes longer gets fewer warmup/minimum rounds
FP32 = "fp32"


@dataclass
class Measurement:
    """Latency of every candidate of one configuration, keyed like ``Suite.candidates``."""

    model: str
    batch: int
    threads: int
    engine: str
    stats: dict[str, LatencyStats]


@dataclass
class Suite:
    """What one run collects: measurements, graph facts per (model, engine), and notes on what was skipped."""

    measurements: list[Measurement] = field(default_factory=list)
    graph_rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    start_load: str = field(default_factory=load_average)
    peak_load: float = 0.0  # highest 1-minute load average seen after a configuration

    def graph_rows_keys(self) -> list[list[str]]:
        return [row[:3] for row in self.graph_rows]

    def note(self, text: str) -> None:
        if text in self.notes:
            return
        self.notes.append(text)
        print(f"note: {text}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet18", "mobilenetv2"],
                        choices=sorted(set(ZOO) - UNTRACEABLE), metavar="MODEL", help="zoo model names")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32], help="batch sizes to time")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="intra-op thread counts")
    parser.add_argument("--engine", default="fbgemm", choices=[*ENGINES, "all"],
                        help="quantized engine of the peers (and fxquant's default backend); 'all' loops over both")
    parser.add_argument("--backends", nargs="+", default=None, metavar="BACKEND",
                        help="fxquant backends to time (default: the engine; 'all': every available backend)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS), metavar="PEER",
                        help=f"peer toolchains to time (default: all of {', '.join(PEERS)})")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of timed rounds per configuration (default 15, or 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny budget, two timed rounds")
    parser.add_argument("--calib-batches", type=int, default=4, help="random calibration batches (default 4)")
    parser.add_argument("--calib-batch-size", type=int, default=8, help="samples per calibration batch")
    args = parser.parse_args(argv)
    if args.time_budget is None:
        args.time_budget = 1.0 if args.quick else 15.0
    args.engines = [e for e in ENGINES if e in torch.backends.quantized.supported_engines] \
        if args.engine == "all" else [args.engine]
    known = available_backends()
    if args.backends == ["all"]:
        args.backends = list(known)
    unknown = sorted({b for engine in args.engines for b in backends_for(args, engine)} - set(known))
    if unknown:
        parser.error(f"unavailable fxquant backend(s) {', '.join(unknown)}; available: {', '.join(known)}")
    return args


def backends_for(args: argparse.Namespace, engine: str) -> list[str]:
    return args.backends or [engine]


def build_candidates(workload: Workload, args: argparse.Namespace, suite: Suite) -> dict[str, dict[str, Candidate]]:
    """engine -> key -> candidate: ``fp32``, ``fxquant:<backend>``, then one per available peer."""
    wanted = sorted({b for engine in args.engines for b in backends_for(args, engine)})
    fxq: dict[str, Candidate] = {}
    prepared = fxquant_calibrated(workload, wanted[0])
    for backend in wanted:
        try:
            fxq[backend] = fxquant_candidate(prepared, backend)
        except FxQuantError as exc:
            suite.note(f"{workload.name}: fxquant[{backend}] skipped: {exc}")
    by_engine = {}
    for engine in args.engines:
        candidates = {FP32: fp32_candidate(workload)}
        candidates.update({f"fxquant:{b}": fxq[b] for b in backends_for(args, engine) if b in fxq})
        for name in args.peers:
            reason = PEERS[name].unavailable_reason(engine)
            try:
                if reason is None:
                    candidates[name] = PEERS[name].build(workload, engine)
            except Exception as exc:  # a peer failing on one model must not end the whole run
                reason = f"failed on {workload.name}: {type(exc).__name__}: {exc}"
            if reason is not None:
                suite.note(f"{PEERS[name].label} ({engine}) skipped: {reason}")
        by_engine[engine] = candidates
    return by_engine


def record_graphs(workload: Workload, engine: str, candidates: dict[str, Candidate], suite: Suite) -> None:
    """Q/DQ node counts, plus SQNR against FP32 so a fast row is not fast by being wrong."""
    inputs = example_inputs(workload.name, 8, seed=0)
    with torch.inference_mode():
        reference = candidates[FP32].run(*inputs)
        for key, candidate in candidates.items():
            # fxquant models do not depend on the engine: one row per model, not one per engine
            row_engine = "-" if key.startswith("fxquant:") else engine
            if candidate.qdq is None or [workload.name, row_engine, candidate.label] in suite.graph_rows_keys():
                continue
            sqnr = sqnr_db(reference, candidate.run(*inputs))
            suite.graph_rows.append([workload.name, row_engine, candidate.label, str(candidate.qdq.quantize),
                                     str(candidate.qdq.dequantize), f"{sqnr:.1f}"])


def _call_once(candidate: Candidate, inputs: tuple[torch.Tensor, ...]) -> float:
    start = time.perf_counter()
    candidate.run(*inputs)
    return time.perf_counter() - start


def _merge(passes: list[dict[str, LatencyStats]]) -> dict[str, LatencyStats]:
    """Mean of the passes' medians and p90s, extremes of their min/max, total runs."""
    def merged(key: str) -> LatencyStats:
        stats = [p[key] for p in passes]
        return LatencyStats(sum(s.median for s in stats) / len(stats), sum(s.p90 for s in stats) / len(stats),
                            min(s.min for s in stats), max(s.max for s in stats), sum(s.runs for s in stats))
    return {key: merged(key) for key in passes[0]}


def measure(candidates: dict[str, Candidate], inputs: tuple[torch.Tensor, ...], threads: int,
            args: argparse.Namespace) -> dict[str, LatencyStats]:
    """Interleaved runs; a first untimed round sizes warmup, minimum rounds and budget to the slowest model.

    ``measure_latency`` keeps one order every round, and on sub-millisecond models whichever call comes right
    after the FP32 model is ~25% slower (measured on the MLP at batch 1; its float weights flush the cache), which
    would decide the peer ratio. Light configurations are therefore timed in two passes, in order and reversed,
    and their medians averaged. ``measure_latency``
    also stops at its budget before ``min_runs``: the budget is raised to fit the minimum rounds of heavy models.
    """
    with num_threads(threads), torch.inference_mode():
        calls = [_call_once(c, inputs) for c in candidates.values()]
    heavy = max(calls) > HEAVY_CALL_S
    min_runs = 2 if args.quick else 3 if heavy else 5
    budget = max(args.time_budget, 1.2 * min_runs * sum(calls))
    fns = {key: (lambda c=c: c.run(*inputs)) for key, c in candidates.items()}
    orders = [list(fns)] if heavy else [list(fns), list(fns)[::-1]]
    return _merge([measure_latency({k: fns[k] for k in order}, threads=threads, warmup=1 if heavy or args.quick
                                   else 3, min_runs=min_runs, time_budget_s=budget / len(orders)) for order in orders])


def _ms(stats: LatencyStats) -> str:
    digits = 3 if stats.median < 1 else 2 if stats.median < 100 else 0
    return f"{stats.median:.{digits}f} ({stats.min:.{digits}f}-{stats.max:.{digits}f})"


def summary_line(m: Measurement, candidates: dict[str, Candidate]) -> str:
    """One progress line: every candidate's latency, then FP32/fxquant and peer/fxquant for the first backend."""
    parts = [f"{candidates[k].label} {_ms(s)} ms" for k, s in m.stats.items()]
    fxq = next((k for k in m.stats if k.startswith("fxquant:")), None)
    if fxq is not None:
        parts += [f"{candidates[k].label}/{candidates[fxq].label} {s.median / m.stats[fxq].median:.2f}"
                  for k, s in m.stats.items() if not k.startswith("fxquant:")]
    return f"{m.model} batch={m.batch} threads={m.threads} engine={m.engine}: " + "; ".join(parts)


def run(args: argparse.Namespace) -> Suite:
    suite = Suite()
    for name in args.models:
        workload = make_workload(name, batches=args.calib_batches, batch_size=args.calib_batch_size)
        for engine, candidates in build_candidates(workload, args, suite).items():
            record_graphs(workload, engine, candidates, suite)
            for batch in args.batches:
                inputs = example_inputs(name, batch, seed=0)
                for threads in args.threads:
                    stats = measure(candidates, inputs, threads, args)
                    suite.measurements.append(Measurement(name, batch, threads, engine, stats))
                    print(summary_line(suite.measurements[-1], candidates), flush=True)
                    suite.peak_load = max(suite.peak_load, load_1min())
    busy = busy_note(suite.peak_load)
    if busy is not None:
        suite.note(busy)
    return suite


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def latency_table(suite: Suite) -> list[str]:
    """One row per (configuration, fxquant backend); each measured peer adds a latency and a ratio column."""
    peers = [p for p in PEERS if any(p in m.stats for m in suite.measurements)]
    header = ["model", "batch", "threads", "engine", "fxquant backend", "FP32 ms", "fxquant ms",
              *(f"{PEERS[p].label} ms" for p in peers), "FP32/fxquant", *(f"{PEERS[p].label}/fxquant" for p in peers),
              "runs"]
    rows = []
    for m in suite.measurements:
        for key in (k for k in m.stats if k.startswith("fxquant:")):
            fxq = m.stats[key].median
            rows.append([m.model, str(m.batch), str(m.threads), m.engine, key.split(":", 1)[1], _ms(m.stats[FP32]),
                         _ms(m.stats[key]), *(_ms(m.stats[p]) if p in m.stats else "-" for p in peers),
                         f"{m.stats[FP32].median / fxq:.2f}",
                         *(f"{m.stats[p].median / fxq:.2f}" if p in m.stats else "-" for p in peers),
                         str(min(s.runs for s in m.stats.values()))])
    return _table(header, rows)


def markdown(suite: Suite, args: argparse.Namespace) -> str:
    lines = [*(f"- {line}" for line in environment_lines()), f"- at the start: {suite.start_load}",
             f"- time budget {args.time_budget:g} s per configuration{' (--quick)' if args.quick else ''}; "
             f"calibration: {args.calib_batches} random batches of {args.calib_batch_size}, same for every tool",
             "- latency: median (min-max) ms per call; ratios of medians; `<peer>/fxquant` >= 1.00: fxquant no slower",
             "", *latency_table(suite), "",
             *_table(["model", "engine", "implementation", "quantize nodes", "dequantize nodes", "SQNR vs FP32 dB"],
                     suite.graph_rows)]
    if suite.notes:
        lines += ["", *(f"- note: {note}" for note in suite.notes)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for line in environment_lines():
        print(line, flush=True)
    start = time.perf_counter()
    suite = run(args)
    print(f"\n(total {time.perf_counter() - start:.0f} s)\n\n{markdown(suite, args)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

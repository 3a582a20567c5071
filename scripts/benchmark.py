"""Latency of fxquant INT8 against FP32 and the INT8 toolchains a user would pick instead, with markdown tables.

Every candidate of one configuration (model, batch, threads) is timed interleaved in one
:func:`fxquant.report.latency.measure_latency` run, so the ratios survive a shared, noisy machine. All INT8 models
are calibrated on the same seeded random batches. Candidates: FP32 eager; fxquant on each backend (and ``auto``);
torch.ao FX on each quantized engine; torchao PT2E + Inductor; ONNX Runtime static INT8 (peers skipped with a note
when their packages are missing). See ``docs/benchmarks.md`` for the columns and the measured tables.

Default plan: the peer matrix (mlp, resnet18, mobilenetv2 at batch 1 and 32, bert_style at 8; 1 and 2 threads;
every fxquant backend and ``auto`` against every peer), and the same-engine comparison (the rest of the zoo at batch 1
and 8, 1 thread, against torch.ao FX on the engines fxquant shares). ``--batches``/``--threads``/``--backends``/
``--peers`` override the plan for every model.

    python scripts/benchmark.py --profile > /tmp/bench.txt     # the full run: ~20 minutes on 2 cores
    python scripts/benchmark.py --quick                         # smoke run: < 1 minute
    python scripts/benchmark.py --models mlp --batches 1 --threads 1 --backends all --peers torch.ao:x86
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from _bench_common import (
    FP32,
    PEERS,
    Candidate,
    Suite,
    Where,
    busy_note,
    environment_lines,
    executed_model,
    fxquant_calibrated,
    fxquant_candidate,
    label,
    latency_table,
    load_1min,
    load_peers,
    make_workload,
    profile_lines,
    sqnr_db,
    sqnr_table,
    zoo_tables,
)
from _bench_common import fp32_candidate as fp32
from _bench_peak import count_macs, peak_line
from _bench_profile import top_ops

import fxquant
from fxquant.errors import FxQuantError
from fxquant.kernels.registry import available_backends
from fxquant.models import example_inputs
from fxquant.report.latency import LatencyStats, measure_latency, num_threads

load_peers()
PEER_MATRIX_MODELS = ("mlp", "resnet18", "mobilenetv2", "bert_style")
ZOO_MODELS = (*PEER_MATRIX_MODELS, "efficientnet", "audio1d", "conv3d", "unet", "control_flow")
PAIRED = ("fbgemm", "qnnpack", "onednn")  # fxquant backends with a torch.ao engine of the same name
PEER_MATRIX_BATCHES = {"bert_style": (8,)}
# What a user is told to set: control_flow's negative branch never runs on post-ReLU inputs, so it has no ranges.
MODEL_CONFIG = {"control_flow": {"exclude": ["gated.negative"]}}
PEAK_ROWS = {("resnet18", 32, 1)}  # rows whose fraction of the CPU's INT8 peak is reported
PEER_TARGET = 0.90  # the peer matrix's target: fastest fxquant / fastest peer at one thread, at most this
HEAVY_CALL_S = 0.25  # a config whose slowest call takes longer gets fewer warmup/minimum rounds


@dataclass(frozen=True)
class Plan:
    """What to run for one model."""

    batches: tuple[int, ...]
    threads: tuple[int, ...]
    backends: tuple[str, ...]  # fxquant backend names, "auto" included
    peers: tuple[str, ...]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=ZOO_MODELS, metavar="MODEL",
                        help=f"zoo models (default: {' '.join(ZOO_MODELS)}; with --quick: mlp control_flow)")
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="batch sizes (default: per model)")
    parser.add_argument("--threads", nargs="+", type=int, default=None, help="intra-op thread counts")
    parser.add_argument("--backends", nargs="+", default=None, metavar="BACKEND",
                        help="fxquant backends ('all': every available one plus auto)")
    parser.add_argument("--peers", nargs="*", default=None, choices=list(PEERS), metavar="PEER",
                        help=f"peers to time (default: per model; known: {', '.join(PEERS)})")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of timed rounds per configuration (default 6, or 0.5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny budget, batch 1, 1 thread")
    parser.add_argument("--max-call-s", type=float, default=2.0,
                        help="time once, not in rounds, a candidate whose call takes longer than this and than FP32")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler top-10 ops of the fastest fxquant and peer where fxquant / peer > "
                        f"{PEER_TARGET} (1 thread)")
    parser.add_argument("--calib-batches", type=int, default=4, help="random calibration batches (default 4)")
    parser.add_argument("--calib-batch-size", type=int, default=8, help="samples per calibration batch")
    parser.add_argument("--auto-batch", type=int, metavar="N", help="fxquant[auto] times its kernels on batch N "
                        "(convert(..., example_inputs=...)); default: the model's example batch (1)")
    args = parser.parse_args(argv)
    args.time_budget = args.time_budget or (0.5 if args.quick else 6.0)
    args.models = args.models or (["mlp", "control_flow"] if args.quick else list(ZOO_MODELS))
    known = available_backends()
    if args.backends == ["all"]:
        args.backends = [*known, "auto"]
    unknown = sorted(set(args.backends or ()) - {*known, "auto"})
    if unknown:
        parser.error(f"unavailable fxquant backend(s) {', '.join(unknown)}; available: {', '.join(known)}, auto")
    return args


def plan_for(name: str, args: argparse.Namespace) -> Plan:
    in_matrix = name in PEER_MATRIX_MODELS
    batches = (1,) if args.quick else PEER_MATRIX_BATCHES.get(name, (1, 32)) if in_matrix else (1, 8)
    threads = (1,) if args.quick or not in_matrix else (1, 2)
    backends = (*available_backends(), "auto") if in_matrix else PAIRED
    peers = tuple(PEERS) if in_matrix else tuple(f"torch.ao:{e}" for e in PAIRED)
    return Plan(tuple(args.batches or batches), tuple(args.threads or threads), tuple(args.backends or backends),
                tuple(peers if args.peers is None else args.peers))


def build_candidates(name: str, plan: Plan, args: argparse.Namespace, suite: Suite) -> dict[str, Candidate]:
    """``fp32``, ``fxquant:<backend>`` for each backend, then one per peer; failures become notes and 'n/a' cells."""
    workload = make_workload(name, batches=args.calib_batches, batch_size=args.calib_batch_size,
                             config=MODEL_CONFIG.get(name))
    if workload.config:
        suite.note(f"{name}: fxquant.QuantConfig({', '.join(f'{k}={v!r}' for k, v in workload.config.items())})")
    candidates = {FP32: fp32(workload)}
    fixed = [b for b in plan.backends if b != "auto"]
    prepared = fxquant_calibrated(workload, fixed[0]) if fixed else None
    for backend in plan.backends:
        try:  # auto is prepared with QuantConfig(backend="auto"), as a user would; qparams are backend-independent
            source = fxquant_calibrated(workload, "auto") if backend == "auto" else prepared
            assert source is not None  # a fixed backend exists whenever this one is not auto
            timing = example_inputs(name, args.auto_batch) if backend == "auto" and args.auto_batch else None
            with num_threads(plan.threads[0]):  # auto measures at convert time: at the plan's first thread count
                candidates[f"fxquant:{backend}"] = fxquant_candidate(source, backend, timing)
            if backend == "auto":  # its choice is measured at convert time, so it can differ between runs
                suite.note(f"{name}: fxquant[auto] chose, at {plan.threads[0]} thread(s), "
                           f"{auto_choices(candidates['fxquant:auto'])}")
        except FxQuantError as exc:
            suite.unavailable(name, f"fxquant:{backend}", f"fxquant[{backend}] does not convert: {exc}")
    drop_duplicate_auto(name, candidates, suite)
    for key in plan.peers:
        peer, started = PEERS[key], time.perf_counter()
        reason = peer.unavailable_reason()
        if reason is None:
            try:
                candidates[key] = peer.build(workload)
            except Exception as exc:  # a peer failing on one model must not end the whole run
                reason = f"{peer.label} fails on {name}: {_reason(exc)}"
        if reason is not None:
            suite.unavailable(name, key, reason)
        elif candidates[key].note:
            suite.note(f"{name}: {peer.label}: {candidates[key].note}")
        print(f"{name}: built {peer.label} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    suite.qdq.update({(name, k): c.qdq for k, c in candidates.items() if c.qdq is not None})
    return candidates


def drop_duplicate_auto(name: str, candidates: dict[str, Candidate], suite: Suite) -> None:
    """``auto`` that executes the same model as a single backend is that backend: timed once, not twice.

    Two draws of one configuration would let the noise pick the faster one for 'fastest fxquant'.
    """
    auto = candidates.get("fxquant:auto")
    if auto is None or auto.model is None:
        return
    signature = executed_model(auto.model)
    for key, candidate in candidates.items():
        if key.startswith("fxquant:") and key != "fxquant:auto" and candidate.model is not None \
                and executed_model(candidate.model) == signature:
            del candidates["fxquant:auto"]
            suite.same[(name, "fxquant:auto")] = key
            suite.note(f"{name}: fxquant[auto] runs the same graph and kernels as {label(key)}: timed once, as "
                       f"{label(key)}")
            return


def auto_choices(candidate: Candidate) -> str:
    assert candidate.model is not None
    layers = Counter(f"{layer.kind} -> {layer.backend or 'float'}"  # float: embeddings, layers kept float
                     for layer in fxquant.coverage(candidate.model).layers)
    return ", ".join(f"{kind} x{count}" for kind, count in layers.most_common())


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _timed(candidate: Candidate, inputs: tuple[torch.Tensor, ...]) -> tuple[object, float]:
    start = time.perf_counter()
    out = candidate.run(*inputs)
    return out, time.perf_counter() - start


def warm_up(candidates: dict[str, Candidate], inputs: tuple[torch.Tensor, ...], where: Where, args: argparse.Namespace,
            suite: Suite) -> tuple[dict[str, Candidate], dict[str, float]]:
    """One untimed call each (Inductor compiles, ORT creates its session; SQNR from its output), then a sizing call.

    A candidate slower than both ``--max-call-s`` and FP32 is not timed in rounds (which ones: docs/benchmarks.md,
    *Method*): its sizing call is reported as approximate, and it is left out at the other thread counts of the same
    model and batch. A first call over three times that limit is enough, unless the candidate is lazy (its first
    call compiled or created a session).
    """
    kept: dict[str, Candidate] = {}
    calls: dict[str, float] = {}
    with num_threads(where[2]), torch.inference_mode():
        reference, _ = _timed(candidates[FP32], inputs)
        for key, candidate in candidates.items():
            if any(k[:2] == where[:2] and k[3] == key for k in suite.slow):
                suite.slow[(*where, key)] = None
                continue
            if (where[0], key) in suite.missing:  # failed at an earlier configuration
                continue
            limit = max(args.max_call_s, calls.get(FP32, 0.0))
            try:
                out, seconds = (reference, 0.0) if key == FP32 else _timed(candidate, inputs)
            except Exception as exc:  # e.g. torch.ao's qnnpack engine has no quantized max_pool3d
                suite.unavailable(where[0], key, f"{label(key)} fails at run time on {where[0]}: {_reason(exc)}")
                continue
            if key != FP32:
                suite.record_sqnr(where[0], key, where[1], sqnr_db(torch.as_tensor(reference), torch.as_tensor(out)))
            if seconds <= 3 * limit or candidate.lazy:
                seconds = _timed(candidate, inputs)[1]
            if key != FP32 and seconds > limit:
                suite.slow[(*where, key)] = seconds * 1e3
                continue
            kept[key], calls[key] = candidate, seconds
    return kept, calls


def measure(candidates: dict[str, Candidate], inputs: tuple[torch.Tensor, ...], threads: int,
            calls: dict[str, float], args: argparse.Namespace) -> dict[str, LatencyStats]:
    """Interleaved runs sized by one untimed round: warmup, minimum rounds and budget follow the slowest model.

    ``measure_latency`` shuffles the order every round, so no candidate always runs right after the FP32 model (that
    call is slower; by how much: docs/benchmarks.md, *Method*). It also stops at its budget before ``min_runs``: the
    budget is raised to fit the minimum rounds of heavy models.
    """
    heavy = max(calls.values()) > HEAVY_CALL_S
    min_runs = 2 if args.quick else 3 if heavy else 10
    budget = max(args.time_budget, 1.2 * min_runs * sum(calls.values()))
    fns = {key: (lambda c=c: c.run(*inputs)) for key, c in candidates.items()}
    return measure_latency(fns, threads=threads, warmup=0 if heavy or args.quick else 3, min_runs=min_runs,
                           time_budget_s=budget)


def fastest(stats: dict[str, LatencyStats]) -> tuple[str, str] | None:
    """The fastest fxquant key and the fastest peer key of one row, or None when a side was not timed."""
    fxq = [k for k in stats if k.startswith("fxquant:")]
    peers = [k for k in stats if k != FP32 and k not in fxq]
    if not fxq or not peers:
        return None
    return min(fxq, key=lambda k: stats[k].median), min(peers, key=lambda k: stats[k].median)


def profile_if_beaten(candidates: dict[str, Candidate], stats: dict[str, LatencyStats],
                      inputs: tuple[torch.Tensor, ...], where: Where, suite: Suite) -> None:
    """Top ops of the fastest fxquant backend and of the fastest torch-based peer, where fxquant misses the target.

    ONNX Runtime's kernels are invisible to torch.profiler, so when it wins the fastest torch-based peer is shown.
    """
    best = fastest(stats)
    if best is None or stats[best[0]].median <= PEER_TARGET * stats[best[1]].median:
        return
    peers = [k for k in stats if k != FP32 and not k.startswith("fxquant:")]
    shown = [k for k in sorted(peers, key=lambda k: stats[k].median) if k != "ort"][:1]
    for key in (best[0], *shown):
        suite.profiles.append((*where, candidates[key].label, top_ops(candidates[key], inputs, threads=where[2])))


def peer_misses(suite: Suite) -> list[str]:
    """Peer-matrix rows at one thread where fastest fxquant / fastest peer is above ``PEER_TARGET``."""
    misses = []
    for where, stats in suite.rows:
        best = fastest(stats) if where[0] in PEER_MATRIX_MODELS and where[2] == 1 else None
        if best is not None and stats[best[0]].median > PEER_TARGET * stats[best[1]].median:
            ours, theirs = stats[best[0]].median, stats[best[1]].median
            misses.append(f"{where[0]} batch {where[1]}: {ours / theirs:.2f} ({label(best[0])} {ours:.3g} ms / "
                          f"{label(best[1])} {theirs:.3g} ms)")
    return misses


def record_peak(fp32: Candidate, stats: dict[str, LatencyStats], inputs: tuple[torch.Tensor, ...], where: Where,
                suite: Suite) -> None:
    """The fastest fxquant model's MACs per second over one core's INT8 peak (the row runs on one thread)."""
    fxq = [k for k in stats if k.startswith("fxquant:")]
    if not fxq:
        return
    best = min(fxq, key=lambda k: stats[k].median)
    what = f"{where[0]} b{where[1]} ({where[2]} thread)"
    assert isinstance(fp32.run, torch.nn.Module)  # the float zoo model
    suite.peak.append(peak_line(what, count_macs(fp32.run, inputs), stats[best].median, label(best)))


def run_model(name: str, args: argparse.Namespace, suite: Suite) -> None:
    plan = plan_for(name, args)
    candidates = build_candidates(name, plan, args, suite)
    for batch in plan.batches:
        inputs = example_inputs(name, batch, seed=0)
        for threads in plan.threads:
            where = (name, batch, threads)
            kept, calls = warm_up(candidates, inputs, where, args, suite)
            stats = measure(kept, inputs, threads, calls, args)
            suite.record(where, stats)
            if args.profile and threads == 1:
                profile_if_beaten(kept, stats, inputs, where, suite)
            if where in PEAK_ROWS:
                record_peak(candidates[FP32], stats, inputs, where, suite)
            suite.peak_load = max(suite.peak_load, load_1min())


def run(args: argparse.Namespace) -> Suite:
    suite = Suite()
    for name in args.models:
        try:  # a long run keeps the tables of every other model when one breaks
            run_model(name, args, suite)
        except Exception as exc:
            traceback.print_exc()
            suite.note(f"{name}: run aborted: {_reason(exc)}")
    busy = busy_note(suite.peak_load)
    if busy is not None:
        suite.note(busy)
    return suite


def markdown(suite: Suite, args: argparse.Namespace) -> str:
    latency, pairs, misses = zoo_tables(suite, PAIRED)
    slow = [f"{label(k)} on {m} batch {b} threads {t}: " + (f"one call took {ms / 1e3:.1f} s, timed once (~)" if ms
            else "too slow at the other thread count, not run") for (m, b, t, k), ms in suite.slow.items()]
    lines = [*(f"- {line}" for line in environment_lines()), f"- at the start: {suite.start_load}",
             f"- time budget {args.time_budget:g} s per configuration{' (--quick)' if args.quick else ''}; "
             f"calibration: {args.calib_batches} random batches of {args.calib_batch_size}, same for every tool",
             "- latency: median ms per call [fastest-slowest call]; `(fxq/peer)`: fastest fxquant backend / that peer, "
             "< 1.00: fxquant faster; `= X`: the same graph and kernels as X, timed once (as X)",
             "", "### The peer matrix: fxquant backends and peers", "", *latency_table(suite, PEER_MATRIX_MODELS),
             "", f"### Peer-matrix rows at 1 thread above {PEER_TARGET:.2f} (fastest fxquant / fastest peer)", "",
             *(f"- {m}" for m in peer_misses(suite) or ["none"]),
             *(["", "### Fraction of the CPU's INT8 peak", "", *(f"- {line}" for line in suite.peak)]
               if suite.peak else []),
             "", "### The same-engine comparison: the zoo, fxquant vs torch.ao FX on the same engine (ratio < 1.00: "
             "fxquant faster)", "",
             *latency, "", *pairs, "", "### SQNR vs FP32 (dB, at the largest batch timed)", "", *sqnr_table(suite),
             "", "### Misses of the same-engine targets (no slower than torch.ao FX, no more Q/DQ nodes)", "",
             *(f"- {m}" for m in misses or ["none"])]
    if suite.profiles:
        lines += ["", f"### Where the time goes (1 thread, rows above {PEER_TARGET:.2f}; torch.profiler, fxquant: node "
                  "by node)",
                  *profile_lines(suite)]
    return "\n".join([*lines, "", *(f"- note: {n}" for n in [*slow, *suite.notes])])


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

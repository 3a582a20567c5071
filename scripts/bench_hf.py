"""Transformers models at realistic sizes on one thread: FP32, fxquant's default and the INT8 tools HF users pick.

Candidates, all from the same float model (random weights from a config, seed 0) and timed interleaved in one
:func:`fxquant.report.latency.measure_latency` run per row at one thread, so their ratios survive a noisy machine:

- FP32 eager;
- fxquant's default: ``fxquant.quantize(model, example, calibration, progress=False)`` with the default QuantConfig,
  calibrated on random batches of the timed shape (token ids, images, mel features; other seeds than the timed one);
- ``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)`` on the process's quantized
  engine (what most HF users pick on CPU; Linear only);
- torchao ``quantize_(model, Int8DynamicActivationInt8WeightConfig())``, eager (no ``torch.compile``).

Rows (``scripts/_bench_hf_models.py``): BERT-base, ViT-B/16 and the Whisper-base encoder at full width with 4
layers, and a 1B-class Llama's 512-token prefill with 4 layers. Per row: median [fastest-slowest] ms, speedups of
fxquant over FP32 and over each peer, SQNR of each candidate's main output against FP32 on the timed inputs, and the
fraction of fxquant's multiply-adds that runs INT8 (``fxquant.coverage(q).int8_mac_fraction``). A candidate that
fails to build or run shows its error in the table. Models are built and calibrated at torch's default thread count.

    python scripts/bench_hf.py                 # the full run: under 15 minutes on 2 cores
    python scripts/bench_hf.py --quick         # tiny dimensions, smoke run: under 2 minutes
    python scripts/bench_hf.py --rows bert vit --time-budget 30
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _bench_common import environment_lines, load_1min, load_average, sqnr_db
from _bench_hf_models import SPECS, HfCase, build_case
from torch import nn

import fxquant
from fxquant.report.latency import LatencyStats, measure_latency, num_threads

THREADS = 1
FP32, FXQ, DYN, TAO = "fp32", "fxquant", "dynamic", "torchao"
LABELS = {FP32: "FP32", FXQ: "fxquant default", DYN: "quantize_dynamic", TAO: "torchao int8-dyn eager"}
PEERS = (DYN, TAO)
SPEEDUP_TARGET = 2.0  # fxquant's default over FP32
HEAVY_CALL_S = 0.25  # a row whose slowest call takes longer runs fewer minimum rounds
QUICK_NOTE = "--quick: tiny dimensions, overhead-bound (a smoke run: its verdicts judge nothing); "


@dataclass
class Row:
    """What one row measured (not its models, freed after the row); a candidate in ``errors`` has no stats."""

    name: str
    dims: str
    stats: dict[str, LatencyStats] = field(default_factory=dict)
    sqnr: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    build_s: dict[str, float] = field(default_factory=dict)
    mac_fraction: float | None = None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(SPECS), choices=list(SPECS), help="rows to run (default all)")
    parser.add_argument("--quick", action="store_true", help="tiny dimensions and budget: a smoke run")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of timed rounds per row (default 60, 1 with --quick); raised to fit the "
                        "minimum rounds of a heavy row")
    parser.add_argument("--calib-batches", type=int, default=8, help="random calibration batches (default 8)")
    args = parser.parse_args(argv)
    args.time_budget = args.time_budget or (1.0 if args.quick else 60.0)
    return args


def _reason(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:160]}"


def build_fxquant(case: HfCase, row: Row) -> nn.Module:
    qmodel = fxquant.quantize(case.model, case.calibration[0], list(case.calibration), progress=False)
    row.mac_fraction = fxquant.coverage(qmodel).int8_mac_fraction
    return qmodel


def build_dynamic(case: HfCase, row: Row) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao warns on every call that it is deprecated
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(case.model), {nn.Linear}, dtype=torch.qint8)


def build_torchao(case: HfCase, row: Row) -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = copy.deepcopy(case.model)
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


BUILDERS: dict[str, Callable[[HfCase, Row], nn.Module]] = {FXQ: build_fxquant, DYN: build_dynamic,
                                                            TAO: build_torchao}


def build_all(case: HfCase, row: Row) -> dict[str, nn.Module]:
    """FP32 and every INT8 candidate; a build that raises is recorded in ``row.errors``, the others go on."""
    models: dict[str, nn.Module] = {FP32: case.model}
    for key, builder in BUILDERS.items():
        start = time.perf_counter()
        try:
            models[key] = builder(case, row)
        except Exception as exc:  # one tool failing on one model must not end the run
            row.errors[key] = f"build: {_reason(exc)}"
        row.build_s[key] = time.perf_counter() - start
        print(f"{case.name}: {LABELS[key]} built in {row.build_s[key]:.1f} s"
              + (f" ({row.errors[key]})" if key in row.errors else ""), file=sys.stderr, flush=True)
    return models


def first_calls(case: HfCase, models: dict[str, nn.Module], row: Row) -> dict[str, float]:
    """One untimed call each at the timed thread count: its output gives the SQNR, its seconds size the rounds."""
    seconds: dict[str, float] = {}
    with num_threads(THREADS), torch.inference_mode():
        reference = case.output(models[FP32](*case.inputs))
        for key, model in models.items():
            start = time.perf_counter()
            try:
                out = case.output(model(*case.inputs))
            except Exception as exc:
                row.errors[key] = f"run: {_reason(exc)}"
                continue
            seconds[key] = time.perf_counter() - start
            if key != FP32:
                row.sqnr[key] = sqnr_db(reference, out)
    return seconds


def run_row(name: str, args: argparse.Namespace) -> Row:
    case = build_case(name, quick=args.quick, calib_batches=args.calib_batches)
    row = Row(case.name, case.dims)
    models = build_all(case, row)
    seconds = first_calls(case, models, row)
    if FP32 not in seconds:
        return row
    heavy = max(seconds.values()) > HEAVY_CALL_S
    min_runs = 2 if args.quick else 3 if heavy else 10
    budget = max(args.time_budget, 1.2 * min_runs * sum(seconds.values()))
    fns = {key: (lambda m=models[key]: m(*case.inputs)) for key in seconds}
    row.stats = measure_latency(fns, threads=THREADS, warmup=1, min_runs=min_runs, time_budget_s=budget)
    print(f"{name}: " + "; ".join(f"{LABELS[k]} {s.median:.1f} ms ({s.runs} rounds)" for k, s in row.stats.items()),
          file=sys.stderr, flush=True)
    return row


def _ms(stats: LatencyStats) -> str:
    digits = 2 if stats.median < 100 else 1 if stats.median < 1000 else 0
    return f"{stats.median:.{digits}f} [{stats.min:.{digits}f}-{stats.max:.{digits}f}]"


def _cell(row: Row, key: str) -> str:
    if key in row.errors:
        return "error: " + row.errors[key].replace("|", "/")
    return _ms(row.stats[key]) if key in row.stats else "-"


def _speedup(row: Row, slower: str) -> str:
    """``slower``'s median over fxquant's: above 1, fxquant is faster."""
    if FXQ not in row.stats or slower not in row.stats:
        return "-"
    return f"{row.stats[slower].median / row.stats[FXQ].median:.2f}x"


def _db(row: Row, key: str) -> str:
    return f"{row.sqnr[key]:.1f}" if key in row.sqnr else "-"


def table(rows: Sequence[Row]) -> list[str]:
    header = ["row", *(f"{LABELS[k]} ms" for k in (FP32, FXQ, *PEERS)), "FP32 / fxquant",
              *(f"{LABELS[k]} / fxquant" for k in PEERS), *(f"SQNR dB {LABELS[k]}" for k in (FXQ, *PEERS)),
              "fxquant INT8 MAC fraction", "rounds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        fraction = "-" if row.mac_fraction is None else f"{100 * row.mac_fraction:.1f}%"
        rounds = str(max((s.runs for s in row.stats.values()), default=0))
        cells = [row.name, *(_cell(row, k) for k in (FP32, FXQ, *PEERS)), _speedup(row, FP32),
                 *(_speedup(row, k) for k in PEERS), *(_db(row, k) for k in (FXQ, *PEERS)), fraction, rounds]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdict(row: Row) -> str:
    """One line: each target met or missed (a target against a peer that failed cannot be judged)."""
    if FXQ not in row.stats or FP32 not in row.stats:
        return f"- {row.name}: fxquant did not run ({row.errors.get(FXQ) or row.errors.get(FP32)}): targets MISSED"
    checks = [(f"{_speedup(row, FP32)} FP32 (target >= {SPEEDUP_TARGET:g}x)",
               row.stats[FP32].median >= SPEEDUP_TARGET * row.stats[FXQ].median)]
    for key in PEERS:
        if key not in row.stats or key not in row.sqnr:
            checks.append((f"vs {LABELS[key]}: not judged ({row.errors.get(key, 'not run')})", None))
            continue
        checks.append((f"{_speedup(row, key)} {LABELS[key]} (target > 1x)",
                       row.stats[key].median > row.stats[FXQ].median))
        checks.append((f"SQNR {_db(row, FXQ)} vs {LABELS[key]} {_db(row, key)} dB (target >=)",
                       row.sqnr.get(FXQ, -math.inf) >= row.sqnr[key]))
    judged = [ok for _, ok in checks if ok is not None]
    status = "all targets met" if all(judged) else f"{judged.count(False)} of {len(judged)} targets MISSED"
    parts = [f"{text}: {'met' if ok else 'MISS'}" if ok is not None else text for text, ok in checks]
    return f"- {row.name}: {status} - " + "; ".join(parts)


def header_lines(args: argparse.Namespace) -> list[str]:
    flags = " ".join(sorted({flag for line in Path("/proc/cpuinfo").read_text().splitlines()
                             if line.startswith("flags") for flag in line.split()} & {"amx_int8", "avx512_vnni"}))
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("transformers", "torchao"))
    return [*environment_lines(), f"/proc/cpuinfo int8 flags: {flags or 'neither avx512_vnni nor amx_int8'}",
            f"{versions}; timed at {THREADS} thread (torch.set_num_threads), built at the default thread count",
            f"fxquant default QuantConfig: {fxquant.QuantConfig()}",
            f"{QUICK_NOTE if args.quick else ''}time budget {args.time_budget:g} s per row; "
            f"calibration: {args.calib_batches} random batches of the timed shape (fxquant only)"]


@dataclass(frozen=True)
class Load:
    """The machine's load: at the start (1/5/15 min) and the highest 1-minute average seen after a row."""

    start: str
    peak: float


def markdown(rows: Sequence[Row], args: argparse.Namespace, load: Load, aborted: Sequence[str]) -> list[str]:
    notes = [f"{r.name}: built in " + ", ".join(f"{LABELS[k]} {s:.0f} s" for k, s in r.build_s.items())
             for r in rows]
    cpus = os.cpu_count() or 1
    busy = (f"the 1-minute load average reached {load.peak:.1f} on {cpus} logical CPUs: other processes shared the "
            "timed core, so milliseconds are inflated and spreads wide; the ratios are of interleaved rounds"
            if load.peak > cpus else None)
    return ["", *(f"- {line}" for line in header_lines(args)), f"- at the start: {load.start}; highest 1-minute "
            f"load after a row: {load.peak:.1f}", "", "Rows:", "",
            *(f"- {r.name}: {r.dims}" for r in rows), "",
            "Latency: median ms per call [fastest-slowest], all candidates interleaved per round. `X / fxquant`: "
            "X's median over fxquant's (above 1x: fxquant faster). SQNR: each candidate's main output (hidden states "
            "or logits) vs FP32 on the timed inputs.", "", *table(rows), "",
            "Verdicts (fxquant's default: >= 2x FP32, faster than each peer, SQNR at least each peer's):", "",
            *(verdict(r) for r in rows), "", *(f"- note: {n}" for n in [*aborted, *notes, *([busy] if busy else [])])]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start_load = load_average()
    print(f"{start_load}; rows: {' '.join(args.rows)}", file=sys.stderr, flush=True)
    start, rows, aborted, peak_load = time.perf_counter(), [], [], load_1min()
    for name in args.rows:
        try:  # a row that breaks outside the candidates (building the float model or its inputs) keeps the others
            rows.append(run_row(name, args))
        except Exception as exc:
            aborted.append(f"{name}: row aborted: {_reason(exc)}")
            print(aborted[-1], file=sys.stderr, flush=True)
        peak_load = max(peak_load, load_1min())
        gc.collect()
    print("\n".join(markdown(rows, args, Load(start_load, peak_load), aborted)))
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

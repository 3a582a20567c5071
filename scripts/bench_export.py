"""fxquant's QDQ ONNX export in ONNX Runtime against ORT's own ``quantize_static`` model of the same float network.

Per zoo model, from the same float model (``torch.manual_seed(0)`` before it is built) and the same seeded
calibration batches (``_bench_common.make_workload``):

- fxquant ONNX: ``prepare`` -> ``calibrate`` -> ``convert`` (the default backend) -> ``fxquant.export(q, "x.onnx")``;
- ORT quantize_static: the float ONNX export, ``quant_pre_process``, ``quantize_static`` (QDQ, QUInt8 activations,
  QInt8 per-channel weights), exactly as the benchmark's ONNX Runtime peer (``_peers_ort.quantize_static_onnx``);
- context: the float ONNX in ORT (FP32 ORT) and fxquant's own converted model in torch (fxquant eager).

Every ONNX model runs in one ``InferenceSession`` per thread count with the same options
(``_peers_ort.session_options``: CPU provider, ``ORT_ENABLE_ALL``, ``--threads`` intra-op threads, one inter-op,
sequential). Candidates are timed interleaved (``interleaved_samples``: a shuffled round robin, warm-up first), and
the ratio fxquant ONNX / quantize_static is taken round by round, so it is paired. SQNR: each output against the
FP32 eager model's on the timed inputs. ``--profile`` lists the ops ORT ran (its profiler) and the node types of both
files where fxquant's ONNX is slower.

    python scripts/bench_export.py                        # mlp, resnet18, mobilenetv2 at batch 1 and 32, bert_style 8
    python scripts/bench_export.py --quick                # smoke run: mlp and resnet18 at batch 1, short budget
    python scripts/bench_export.py --models resnet18 --batches 32 --time-budget 60 --profile --json /tmp/rows.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _bench_common import (
    busy_note,
    environment_lines,
    fxquant_calibrated,
    fxquant_candidate,
    load_1min,
    make_workload,
    sqnr_db,
)
from _bench_profile import Row as OpRow
from _bench_profile import ort_ops
from _peers_ort import OrtSessions, quantize_static_onnx
from benchmark import MODEL_CONFIG, PEER_MATRIX_BATCHES, PEER_MATRIX_MODELS, ZOO_MODELS

import fxquant
from fxquant.models import example_inputs
from fxquant.report.latency import interleaved_samples, num_threads

DEFAULT_BACKEND = fxquant.QuantConfig().backend
FP32, ORT_FP32, EAGER, FXQ, STATIC = "fp32", "ort_fp32", "fxquant_eager", "fxquant_onnx", "ort_static"
LABELS = {FP32: "FP32 eager", ORT_FP32: "FP32 ORT", EAGER: f"fxquant[{DEFAULT_BACKEND}] eager",
          FXQ: "fxquant ONNX", STATIC: "ORT quantize_static"}
TIMED = (ORT_FP32, EAGER, FXQ, STATIC)  # FP32 eager is the SQNR reference only
NO_SLOWER = 1.0
Runner = Callable[..., Any]


@dataclass(frozen=True)
class Spread:
    """Median, its 95% confidence interval, quartiles and extremes of one sample (ms per call, or per-round ratios).

    The interval is distribution-free: the order statistics ``n/2 -+ 1.96 sqrt(n)/2`` (a binomial count of the
    samples below the median), so one slow round on a shared machine moves it by one rank, not by its size.
    """

    median: float
    ci_low: float
    ci_high: float
    q1: float
    q3: float
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        ordered, n = sorted(samples), len(samples)
        q1, _, q3 = statistics.quantiles(ordered, n=4) if n > 1 else (ordered[0],) * 3
        ranks = math.ceil(0.98 * math.sqrt(n))
        return cls(statistics.median(ordered), ordered[max(0, (n - 1) // 2 - ranks)],
                   ordered[min(n - 1, n // 2 + ranks)], q1, q3, ordered[0], ordered[-1])


@dataclass
class Built:
    """One model's candidates (its ONNX models also by key, for the profiler), what failed to build, and notes."""

    run: dict[str, Runner] = field(default_factory=dict)
    onnx: dict[str, OrtSessions] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add_onnx(self, key: str, sessions: OrtSessions) -> None:
        self.run[key] = self.onnx[key] = sessions

    def int8_nodes(self) -> dict[str, dict[str, int]]:
        """Node types of each INT8 ONNX file, before ORT's optimisations."""
        return {key: node_types(s.model_bytes) for key, s in self.onnx.items() if key in (FXQ, STATIC)}


@dataclass
class Result:
    """One (model, batch) row: ms per candidate, the paired ratio, SQNRs, failures, and ORT's op profile."""

    model: str
    batch: int
    threads: int
    ms: dict[str, Spread] = field(default_factory=dict)
    ratio: Spread | None = None
    sqnr: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    rounds: int = 0
    profile: dict[str, list[OpRow]] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=ZOO_MODELS, metavar="MODEL",
                        help=f"zoo models (default: {' '.join(PEER_MATRIX_MODELS)}; --quick: mlp resnet18)")
    parser.add_argument("--batches", nargs="+", type=int, help="batch sizes (default: benchmark.py's peer matrix)")
    parser.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads (default 1)")
    parser.add_argument("--time-budget", type=float, help="seconds of timed rounds per row (default 10; --quick 0.5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: two models at batch 1, short budget")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--profile", nargs="?", const="slower", choices=("slower", "all"),
                        help="ORT profiler ops and file node types of both INT8 ONNX models on rows where fxquant's "
                        "is slower (median ratio > 1), or on every row")
    parser.add_argument("--calib-batches", type=int, default=4, help="random calibration batches (default 4)")
    parser.add_argument("--calib-batch-size", type=int, default=8, help="samples per calibration batch")
    args = parser.parse_args(argv)
    args.models = args.models or (["mlp", "resnet18"] if args.quick else list(PEER_MATRIX_MODELS))
    args.time_budget = args.time_budget or (0.5 if args.quick else 10.0)
    return args


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:240]}"


def node_types(model_bytes: bytes) -> dict[str, int]:
    import onnx

    return dict(Counter(node.op_type for node in onnx.load_from_string(model_bytes).graph.node).most_common())


def export_fxquant(qmodel: torch.nn.Module) -> OrtSessions:
    """``fxquant.export(qmodel, "x.onnx")`` in a scratch directory, as sessions fed by the file's own input names."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        data = fxquant.export(qmodel, Path(tmp, "x.onnx")).read_bytes()
    names = [value.name for value in onnx.load_from_string(data).graph.input]
    return OrtSessions(data, names)


def build(name: str, args: argparse.Namespace) -> Built:
    """FP32 eager, then quantize_static (with the float ONNX), then fxquant eager and its export; a step that raises
    leaves its candidates out (their cells read 'error') and the others go on."""
    torch.manual_seed(0)
    workload = make_workload(name, batches=args.calib_batches, batch_size=args.calib_batch_size,
                             config=MODEL_CONFIG.get(name))
    built = Built(run={FP32: workload.model})
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # torch.onnx reports its progress on stdout
            static = quantize_static_onnx(workload)
        built.add_onnx(ORT_FP32, OrtSessions(static.float_model, static.names))
        built.add_onnx(STATIC, OrtSessions(static.int8_model, static.names))
        built.notes += [f"{name}: quantize_static: {static.note}"] if static.note else []
    except Exception as exc:  # one tool failing on one model must not end the run
        built.errors[ORT_FP32] = built.errors[STATIC] = f"build: {_reason(exc)}"
    try:
        qmodel = fxquant_candidate(fxquant_calibrated(workload, DEFAULT_BACKEND), DEFAULT_BACKEND).model
        assert qmodel is not None  # fxquant_candidate keeps the converted model
        built.run[EAGER] = qmodel
        built.add_onnx(FXQ, export_fxquant(qmodel))
    except Exception as exc:
        built.errors.update({key: f"build: {_reason(exc)}" for key in (EAGER, FXQ) if key not in built.run})
    print(f"{name}: built in {time.perf_counter() - started:.0f} s"
          + "".join(f"; {LABELS[k]}: {e}" for k, e in built.errors.items()), file=sys.stderr, flush=True)
    return built


def first_calls(built: Built, inputs: tuple[torch.Tensor, ...], result: Result) -> dict[str, float]:
    """One untimed call each (ORT creates its session here): SQNR against FP32 eager, and seconds per call."""
    seconds: dict[str, float] = {}
    reference = torch.as_tensor(built.run[FP32](*inputs))
    outputs = {}
    for key in (k for k in TIMED if k in built.run):
        try:
            outputs[key] = torch.as_tensor(built.run[key](*inputs))
            start = time.perf_counter()
            built.run[key](*inputs)
            seconds[key] = time.perf_counter() - start
        except Exception as exc:
            result.errors[key] = f"run: {_reason(exc)}"
            continue
        result.sqnr[key] = sqnr_db(reference, outputs[key])
    if FXQ in outputs and EAGER in outputs:
        result.sqnr["fxquant_onnx_vs_eager"] = sqnr_db(outputs[EAGER], outputs[FXQ])
    return seconds


def time_row(name: str, batch: int, built: Built, args: argparse.Namespace) -> Result:
    result = Result(name, batch, args.threads, errors=dict(built.errors))
    inputs = example_inputs(name, batch, seed=0)
    with num_threads(args.threads), torch.inference_mode():
        seconds = first_calls(built, inputs, result)
        min_runs = 3 if args.quick else 15
        budget = max(args.time_budget, 1.2 * min_runs * sum(seconds.values()))
        fns = {key: (lambda run=built.run[key]: run(*inputs)) for key in seconds}
        samples = interleaved_samples(fns, warmup=0 if args.quick else 1, min_runs=min_runs, max_runs=400,
                                      time_budget_s=budget)
    result.ms = {key: Spread.of(s) for key, s in samples.items()}
    result.rounds = max((len(s) for s in samples.values()), default=0)
    if FXQ in samples and STATIC in samples:
        result.ratio = Spread.of([a / b for a, b in zip(samples[FXQ], samples[STATIC], strict=True)])
    if args.profile == "all" or (args.profile and result.ratio and result.ratio.median > NO_SLOWER):
        result.profile = {key: ort_ops(built.onnx[key], inputs, threads=args.threads) for key in (FXQ, STATIC)}
    print(f"{name} batch {batch}: " + "; ".join(f"{LABELS[k]} {s.median:.3f} ms" for k, s in result.ms.items())
          + (f"; ratio {result.ratio.median:.2f}" if result.ratio else ""), file=sys.stderr, flush=True)
    return result


def verdict(ratio: Spread | None) -> str:
    """Of the paired ratio's median: faster (its whole 95% interval below 1), no slower (at most 1), within noise
    (above 1, its interval reaching 1) or SLOWER (the whole interval above 1)."""
    if ratio is None:
        return "-"
    if ratio.ci_high < NO_SLOWER:
        return "faster"
    if ratio.median <= NO_SLOWER:
        return "no slower"
    return "within noise" if ratio.ci_low <= NO_SLOWER else "SLOWER"


def _ms(result: Result, key: str) -> str:
    if key in result.errors:
        return "error"
    s = result.ms.get(key)
    digits = 3 if s and s.median < 10 else 1
    return f"{s.median:.{digits}f} [{s.low:.{digits}f}-{s.high:.{digits}f}]" if s else "-"


def _db(result: Result, key: str) -> str:
    return f"{result.sqnr[key]:.1f}" if key in result.sqnr else "-"


def _ratio(ratio: Spread) -> str:
    return f"{ratio.median:.2f} [{ratio.ci_low:.2f}-{ratio.ci_high:.2f}] ({ratio.q1:.2f}-{ratio.q3:.2f})"


def table(results: Sequence[Result]) -> list[str]:
    header = ["model", "batch", *(f"{LABELS[k]} ms" for k in TIMED), "fxquant ONNX / quantize_static [95% CI] (IQR)",
              "verdict", "SQNR dB fxquant ONNX", "SQNR dB quantize_static", "SQNR dB fxquant eager",
              "SQNR dB fxquant ONNX vs eager", "rounds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in results:
        ratio = _ratio(r.ratio) if r.ratio else "-"
        cells = [r.model, str(r.batch), *(_ms(r, k) for k in TIMED), ratio, verdict(r.ratio),
                 *(_db(r, k) for k in (FXQ, STATIC, EAGER, "fxquant_onnx_vs_eager")), str(r.rounds)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(results: Sequence[Result]) -> str:
    judged = [r for r in results if r.ratio is not None]
    if not judged:
        return "Summary: no row has both INT8 ONNX models timed."
    verdicts = Counter(verdict(r.ratio) for r in judged)
    ok = sum(verdicts[v] for v in ("faster", "no slower", "within noise"))
    worst = max(judged, key=lambda r: r.ratio.median if r.ratio else 0.0)
    assert worst.ratio is not None
    return (f"Summary: fxquant ONNX is no slower than ORT quantize_static on {ok} of {len(judged)} (model, batch) rows "
            f"({', '.join(f'{n} {v}' for v, n in verdicts.items())}); worst ratio "
            f"{_ratio(worst.ratio)} ({worst.model} batch {worst.batch}).")


def profile_lines(results: Sequence[Result], built_nodes: dict[str, dict[str, dict[str, int]]]) -> list[str]:
    """Per profiled row: ORT's executed op types (after its fusions) and, per model, the node types of both files."""
    lines: list[str] = []
    for r in (r for r in results if r.profile):
        ops = {key: {op: (ms, n) for op, ms, n in rows} for key, rows in r.profile.items()}
        names = sorted(set(ops[FXQ]) | set(ops[STATIC]), key=lambda op: -max(ops[k].get(op, (0, 0))[0] for k in ops))
        lines += ["", f"{r.model} batch {r.batch}, {r.threads} thread(s): ops ORT ran (kernel ms per call, nodes)", "",
                  f"| op | {LABELS[FXQ]} | {LABELS[STATIC]} |", "|---|---|---|"]
        lines += [f"| {op} | " + " | ".join(f"{ops[k][op][0]:.3f} ({ops[k][op][1]})" if op in ops[k] else "-"
                                             for k in (FXQ, STATIC)) + " |" for op in names]
        lines.append("| total | " + " | ".join(f"{sum(ms for ms, _ in ops[k].values()):.3f}" for k in (FXQ, STATIC))
                     + " |")
    for model in dict.fromkeys(r.model for r in results if r.profile):
        nodes = built_nodes[model]
        types = sorted(set(nodes.get(FXQ, {})) | set(nodes.get(STATIC, {})))
        lines += ["", f"{model}: node types of the ONNX files (before ORT's optimisations)", "",
                  f"| node | {LABELS[FXQ]} | {LABELS[STATIC]} |", "|---|---|---|",
                  *(f"| {t} | {nodes.get(FXQ, {}).get(t, 0)} | {nodes.get(STATIC, {}).get(t, 0)} |" for t in types)]
    return lines


def header_lines(args: argparse.Namespace) -> list[str]:
    import onnx
    import onnxruntime

    quick = " (--quick)" if args.quick else ""
    return [*environment_lines(), f"onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}; {args.threads} "
            f"thread(s) for torch and ORT; time budget {args.time_budget:g} s per row{quick}; calibration: "
            f"{args.calib_batches} random batches of {args.calib_batch_size}, the same for both tools",
            "ms: median [fastest-slowest call]; ratio: median of the per-round ratios [its 95% confidence interval] "
            "(quartiles), < 1: fxquant faster; verdict 'within noise': above 1.00, the interval reaching it; SQNR "
            "against FP32 eager"]


def run(args: argparse.Namespace) -> tuple[list[Result], dict[str, dict[str, dict[str, int]]], list[str]]:
    results: list[Result] = []
    nodes: dict[str, dict[str, dict[str, int]]] = {}
    notes: list[str] = []
    peak = load_1min()
    for name in args.models:
        try:  # a model that breaks outside the candidates keeps the rows of the others
            built = build(name, args)
            nodes[name], notes = built.int8_nodes(), [*notes, *built.notes]
            batches = args.batches or ((1,) if args.quick else PEER_MATRIX_BATCHES.get(name, (1, 32)))
            for batch in batches:
                results.append(time_row(name, batch, built, args))
                peak = max(peak, load_1min())
        except Exception as exc:
            traceback.print_exc()
            notes.append(f"{name}: aborted: {_reason(exc)}")
    busy = busy_note(peak)
    notes += [busy] if busy else []
    notes += [f"{r.model} batch {r.batch}: {LABELS[k]}: {e}" for r in results for k, e in r.errors.items()]
    return results, nodes, list(dict.fromkeys(notes))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    results, nodes, notes = run(args)
    lines = [*(f"- {line}" for line in header_lines(args)), "", *table(results), "", summary(results),
             *profile_lines(results, nodes), "", *(f"- note: {n}" for n in notes)]
    print("\n".join(lines) + f"\n\n(total {time.perf_counter() - start:.0f} s)")
    if args.json:
        rows = [{**asdict(r), "verdict": verdict(r.ratio), "onnx_nodes": nodes.get(r.model, {})} for r in results]
        args.json.write_text(json.dumps({"environment": header_lines(args), "rows": rows, "notes": notes}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

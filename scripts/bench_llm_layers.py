"""Per-Linear latency of the few-row loops of the dynamic and weight-only schemes against what they replace.

An LLM's decode step runs each Linear on one row per sequence, once per token, on weights that come from memory
(hundreds of MB of them: no cache holds them between two tokens). So each case cycles through enough distinct
weights of one shape to exceed the last-level cache, and times one call per weight, interleaved with
:func:`fxquant.report.latency.measure_latency` so the ratios are paired on a noisy machine:

- ``fp32``: ``F.linear`` on float32 weights (the float model);
- ``weight_only``: :func:`fxquant.kernels.weight_only.weight_only_linear` (the C loop up to 8 rows), and
  ``weight_only, no loop``: the same with the loops off (weights dequantized a block at a time, torch's GEMM);
- ``dynamic``: :func:`fxquant.kernels.per_token.per_token_linear` (the VNNI loop up to 8 rows), and ``dynamic,
  no loop``: ``torch._int_mm`` and the torch rescale;
- ``dynamic_group``: :func:`fxquant.kernels.per_group.per_group_linear` (the VNNI loop at any number of rows), and
  ``dynamic_group, no loop``: its torch path (float32 GEMMs per group of inputs).

At each ``--threads`` count the engines and the loops (OpenMP, on torch's threads) split their work across torch's
threads; where the loops are slower than what they replace, ``fxquant.native.THREAD_LIMITS`` must stop them
(docs/amx.md, "Threads"). Shapes: SmolLM2-135M's (576 hidden, 1536 MLP) and a 1B-class decoder's (2048, 8192);
``--rows 1,512`` adds a prefill's rows.

    python scripts/bench_llm_layers.py [--threads 1,2] [--rows 1,4] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from itertools import cycle
from typing import Any

import torch
import torch.nn.functional as F
from _bench_common import environment_lines

from fxquant import native
from fxquant.kernels.per_group import group_size, pack_weights, per_group_linear
from fxquant.kernels.per_token import per_token_linear
from fxquant.kernels.weight_only import weight_only_linear
from fxquant.report.latency import measure_latency

SHAPES = [(576, 1536, "SmolLM2 gate/up"), (1536, 576, "SmolLM2 down"), (2048, 8192, "1B-class gate/up")]
CACHE_BYTES = 64 << 20  # more int8 weight bytes than a server's last-level cache holds


def _cases(rows: int, k: int, n: int) -> dict[str, Callable[[], Any]]:
    count = max(2, CACHE_BYTES // (k * n))
    floats = [torch.randn(n, k) for _ in range(count)] if count * k * n * 4 <= 4 * CACHE_BYTES else []
    ints = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(count)]
    sums = [w.sum(dim=1, dtype=torch.int32) for w in ints]
    group = group_size(k) or 4
    packed = [pack_weights(w, group) for w in ints]
    scale, x = torch.rand(n) / 100, torch.randn(rows, k)
    float_ring, int_ring = cycle(floats or [torch.randn(n, k)]), cycle(range(count))

    def off(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            saved, native.loops = native.loops, None
            try:
                return fn()
            finally:
                native.loops = saved
        return call

    def weight_only(ring: Iterator[int]) -> Any:
        return weight_only_linear(x, ints[next(ring)], scale, None)

    def dynamic(ring: Iterator[int], with_sums: bool) -> Any:
        i = next(ring)
        return per_token_linear(x, ints[i], scale, None, weight_sums=sums[i] if with_sums else None)

    def dynamic_group(ring: Iterator[int]) -> Any:
        weights, group_sums = packed[next(ring)]
        return per_group_linear(x, weights, group_sums, scale, None, out_features=n, group=group)

    return {"fp32": lambda: F.linear(x, next(float_ring)),
            "weight_only": lambda: weight_only(int_ring),
            "weight_only, no loop": off(lambda: weight_only(int_ring)),
            "dynamic": lambda: dynamic(int_ring, True),
            "dynamic, no loop": lambda: dynamic(int_ring, False),
            "dynamic_group": lambda: dynamic_group(int_ring),
            "dynamic_group, no loop": off(lambda: dynamic_group(int_ring))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 4])
    parser.add_argument("--budget", type=float, default=4.0, help="seconds per case (default 4)")
    args = parser.parse_args()
    print("\n".join(environment_lines()))
    print(f"thread limit of the loops: {native.THREAD_LIMITS['weight_only']} (fxquant.native.THREAD_LIMITS)\n")
    names = ("fp32", "weight_only", "weight_only, no loop", "dynamic", "dynamic, no loop", "dynamic_group",
             "dynamic_group, no loop")
    print("| threads | layer | rows | fp32 | weight_only | no loop | dynamic | no loop | dynamic_group | no loop | "
          "fp32 / weight_only | fp32 / dynamic | fp32 / dynamic_group |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for k, n, label in SHAPES:
            for rows in args.rows:
                stats = measure_latency(_cases(rows, k, n), threads=threads, time_budget_s=args.budget)
                cells = [f"{stats[name].median * 1000:.0f} us [{stats[name].min * 1000:.0f}-"
                         f"{stats[name].max * 1000:.0f}]" for name in names]
                ratios = [f"{stats['fp32'].median / stats[name].median:.2f}"
                          for name in ("weight_only", "dynamic", "dynamic_group")]
                print(f"| {threads} | {label} ({k} -> {n}) | {rows} | {' | '.join(cells)} | {' | '.join(ratios)} |",
                      flush=True)


if __name__ == "__main__":
    main()

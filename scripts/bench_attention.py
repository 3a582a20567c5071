"""A decoder's causal prefill attention: fxquant's loop (what converted transformers models run) against torch's.

Per case (heads / kv heads / head dim of a real decoder, a prefill of ``--tokens``), timed interleaved with
:func:`fxquant.report.latency.measure_latency` (paired rounds, medians [fastest-slowest]):

- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``, the call transformers'
  ``"sdpa"`` makes for an unpadded prefill (torch's CPU flash attention);
- ``fxquant``: :func:`fxquant.native.attention.causal_attention_into` on the same views, writing the
  (batch, tokens, heads, dim) layout transformers returns (SDPA's output still needs that transpose copy);
- ``eager``: transformers' ``"eager"`` computation (``q k^T`` on repeated kv heads, softmax, ``@ v``).

and each one's largest error against the same attention in float64. The query is a transposed view, as
transformers passes it.

    python scripts/bench_attention.py [--threads 1,2] [--tokens 128,512,2048] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _bench_common import environment_lines

from fxquant.native.attention import causal_attention_into
from fxquant.report.latency import measure_latency

SHAPES = [(9, 3, 64, "SmolLM2-135M"), (14, 2, 64, "Qwen2.5-0.5B"), (32, 8, 64, "Llama-3.2-1B"),
          (32, 32, 128, "Llama-2-7B")]


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-2, -1) * scale
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return (probs @ v.repeat_interleave(group, 1)).transpose(1, 2).contiguous()


def _cases(heads: int, kv_heads: int, dim: int,
           tokens: int) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """The timed calls, and the attention of their inputs in float64."""
    q = torch.randn(1, tokens, heads, dim).transpose(1, 2)
    k, v = torch.randn(1, kv_heads, tokens, dim), torch.randn(1, kv_heads, tokens, dim)
    scale = dim ** -0.5
    mask = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).contiguous()

    def fxquant() -> torch.Tensor:
        out = torch.empty(1, tokens, heads, dim)
        if not causal_attention_into(out.transpose(1, 2), q, k, v, scale):
            raise SystemExit("the attention loop cannot run here (no AVX-512, FXQUANT_ISA or FXQUANT_NATIVE=0)")
        return out

    cases = {"sdpa": sdpa, "fxquant": fxquant, "eager": lambda: _eager(q, k, v, mask, scale)}
    return cases, _eager(q.double(), k.double(), v.double(), mask, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[128, 512, 2048])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per case (default 3)")
    args = parser.parse_args()
    print("\n".join(environment_lines()))
    print("\n| threads | model (heads / kv / dim) | tokens | sdpa ms | fxquant ms | eager ms | sdpa / fxquant | "
          "max error sdpa / fxquant / eager |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for heads, kv_heads, dim, label in SHAPES:
            for tokens in args.tokens:
                cases, reference = _cases(heads, kv_heads, dim, tokens)
                stats = measure_latency(cases, threads=threads, time_budget_s=args.budget)
                cells = [f"{s.median:.2f} [{s.min:.2f}-{s.max:.2f}]" for s in (stats[n] for n in cases)]
                errors = " / ".join(f"{float((fn().double() - reference).abs().max()):.1e}" for fn in cases.values())
                print(f"| {threads} | {label} ({heads} / {kv_heads} / {dim}) | {tokens} | {' | '.join(cells)} | "
                      f"{stats['sdpa'].median / stats['fxquant'].median:.2f} | {errors} |", flush=True)


if __name__ == "__main__":
    main()

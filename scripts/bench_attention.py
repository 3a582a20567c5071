"""fxquant's attention loops against torch's: a decoder's causal prefill, and attention over every key (encoders,
cross-attention).

``--kind causal``: per case (heads / kv heads / head dim of a real decoder, a prefill of ``--tokens``), timed
interleaved with :func:`fxquant.report.latency.measure_latency` (paired rounds, medians [fastest-slowest]):

- ``sdpa``: ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``, the call transformers'
  ``"sdpa"`` makes for an unpadded prefill (torch's CPU flash attention);
- ``fxquant``: :func:`fxquant.native.attention.causal_attention_into` on the same views, writing the
  (batch, tokens, heads, dim) layout transformers returns (SDPA's output still needs that transpose copy);
- ``eager``: transformers' ``"eager"`` computation (``q k^T`` on repeated kv heads, softmax, ``@ v``).

and each one's largest error against the same attention in float64. The query is a transposed view, as
transformers passes it.

``--kind full``: per case (the attention shapes of real encoders, batch / heads / query tokens / key tokens / head
dim, some with a padding mask), ``sdpa`` is ``F.scaled_dot_product_attention`` and ``fxquant``
:func:`fxquant.runtime.attention.scaled_dot_product_attention` (the full loop: what a converted model's SDPA nodes
run), both on (batch, tokens, heads, dim) tensors viewed as (batch, heads, tokens, dim), as traced encoders make
them; errors as above.

    python scripts/bench_attention.py [--kind causal|full|both] [--threads 1,2] [--tokens 128,512,2048]
                                      [--budget SECONDS]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _bench_common import environment_lines

from fxquant.native.attention import causal_attention_into, full_attention_into
from fxquant.report.latency import measure_latency
from fxquant.runtime import attention

SHAPES = [(9, 3, 64, "SmolLM2-135M"), (14, 2, 64, "Qwen2.5-0.5B"), (32, 8, 64, "Llama-3.2-1B"),
          (32, 32, 128, "Llama-2-7B")]
# (batch, heads, query tokens, key tokens, head dim, padded, what): attention over every key
FULL_SHAPES = [(8, 4, 128, 128, 64, False, "zoo bert_style, batch 8"),
               (16, 12, 128, 128, 32, True, "MiniLM-L6, batch 16, padded"),
               (1, 12, 384, 384, 64, True, "BERT-base, 384 tokens, padded"),
               (8, 12, 197, 197, 64, False, "ViT-B/16, batch 8"),
               (1, 6, 257, 257, 64, False, "DINOv2-S/14"),
               (1, 6, 1500, 1500, 64, False, "Whisper-tiny encoder"),
               (1, 6, 1, 1500, 64, False, "Whisper-tiny cross-attention, one token")]


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


def _full_cases(batch: int, heads: int, q_tokens: int, kv_tokens: int, dim: int,
                padded: bool) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """The timed calls over every key (a bool padding mask cutting each sequence's last quarter where ``padded``),
    and their attention in float64."""
    q = torch.randn(batch, q_tokens, heads, dim).transpose(1, 2)
    k, v = (torch.randn(batch, kv_tokens, heads, dim).transpose(1, 2) for _ in range(2))
    mask = None
    if padded:  # as transformers' mask builder expands it
        mask = (torch.arange(kv_tokens) < kv_tokens - kv_tokens // 4).expand(batch, 1, q_tokens, kv_tokens)
    cases = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
             "fxquant": lambda: attention.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
    probe = torch.empty_like(q)
    if not full_attention_into(probe, q, k, v, dim ** -0.5, mask):
        raise SystemExit("the attention loop cannot run here (no AVX-512, FXQUANT_ISA or FXQUANT_NATIVE=0)")
    return cases, F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


def _row(cases: dict[str, Callable[[], torch.Tensor]], reference: torch.Tensor, threads: int, budget: float,
         first: str) -> str:
    stats = measure_latency(cases, threads=threads, time_budget_s=budget)
    cells = [f"{s.median:.2f} [{s.min:.2f}-{s.max:.2f}]" for s in (stats[n] for n in cases)]
    errors = " / ".join(f"{float((fn().double() - reference).abs().max()):.1e}" for fn in cases.values())
    ratio = stats["sdpa"].median / stats["fxquant"].median
    return f"| {threads} | {first} | {' | '.join(cells)} | {ratio:.2f} | {errors} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=("causal", "full", "both"), default="both")
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2])
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[128, 512, 2048])
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per case (default 3)")
    args = parser.parse_args()
    print("\n".join(environment_lines()))
    if args.kind in ("causal", "both"):
        print("\n| threads | model (heads / kv / dim) | tokens | sdpa ms | fxquant ms | eager ms | sdpa / fxquant | "
              "max error sdpa / fxquant / eager |")
        print("|---|---|---|---|---|---|---|---|")
        for threads in args.threads:
            for heads, kv_heads, dim, label in SHAPES:
                for tokens in args.tokens:
                    cases, reference = _cases(heads, kv_heads, dim, tokens)
                    print(_row(cases, reference, threads, args.budget,
                               f"{label} ({heads} / {kv_heads} / {dim}) | {tokens}"), flush=True)
    if args.kind in ("full", "both"):
        print("\n| threads | attention over every key | batch / heads / queries / keys / dim | sdpa ms | fxquant ms | "
              "sdpa / fxquant | max error sdpa / fxquant |")
        print("|---|---|---|---|---|---|---|")
        for threads in args.threads:
            for batch, heads, q_tokens, kv_tokens, dim, padded, label in FULL_SHAPES:
                cases, reference = _full_cases(batch, heads, q_tokens, kv_tokens, dim, padded)
                print(_row(cases, reference, threads, args.budget,
                           f"{label} | {batch} / {heads} / {q_tokens} / {kv_tokens} / {dim}"), flush=True)


if __name__ == "__main__":
    main()

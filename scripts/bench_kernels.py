"""Micro-benchmark of the int8 kernels of every available backend against FP32, on the same shapes in one run.

Times one int8 linear/conv call on an already-quantized input (int8 in, int8 out, weights prepacked) next to the
FP32 ``F.linear``/``F.conv2d`` on the float input; quantizing the input is not included. Then ResNet's stem max pool
on channels-last uint8: the onednn backend's pool (fxquant's C loop) against ``quantized::max_pool2d``, the op it
used before and PT2E's lowering calls. Then a transformer's residual add and LayerNorm, ``norm(a + b)``, on the
float32 shapes of BERT-style encoders: fxquant's loop (what a converted model's graph walk runs,
:mod:`fxquant.runtime.add_norm`) against torch's two ops. Calls are interleaved round by round
(``fxquant.report.latency.measure_latency``), so ratios hold on a noisy machine.

    python scripts/bench_kernels.py [--budget SECONDS] [--threads N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxquant import native
from fxquant.kernels.base import Backend, ConvSpec
from fxquant.kernels.onednn.max_pool import channels_last_max_pool
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.native.isa import cpu_model, isa_summary
from fxquant.qparams import affine_qparams, symmetric_qparams
from fxquant.qparams import quantize as quantize_weight
from fxquant.report.latency import measure_latency
from fxquant.runtime import add_norm


@dataclass(frozen=True)
class Workload:
    """One layer at one batch size: ``spec`` is None for a linear layer."""

    label: str
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    spec: ConvSpec | None = None


CONV_3X3 = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
WORKLOADS = (
    Workload("linear 1024x1024, batch 1", (1, 1024), (1024, 1024)),
    Workload("linear 1024x1024, batch 64", (64, 1024), (1024, 1024)),
    Workload("conv 64->64 3x3 @56x56, batch 1", (1, 64, 56, 56), (64, 64, 3, 3), CONV_3X3),
    Workload("conv 64->64 3x3 @56x56, batch 32", (32, 64, 56, 56), (64, 64, 3, 3), CONV_3X3),
)
POOL_SHAPES = ((1, 64, 112, 112), (32, 64, 112, 112))  # ResNet-18's stem pool input at batch 1 and 32
# (batch, tokens, hidden): the zoo's BERT-style encoder at batch 8, BERT-base at batch 1 and 8, ViT-B/16 at batch 1
NORM_SHAPES = ((8, 128, 256), (1, 128, 768), (8, 128, 768), (1, 197, 768))
STEM_POOL = {"kernel_size": 3, "stride": 2, "padding": 1}


def _float_call(work: Workload, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Callable[[], Any]:
    if work.spec is None:
        return lambda: F.linear(x, w, b)
    spec = work.spec
    return lambda: F.conv2d(x, w, b, spec.stride, spec.padding, spec.dilation, spec.groups)


def _int8_call(backend: Backend, work: Workload, x: torch.Tensor, w: torch.Tensor,
               b: torch.Tensor) -> Callable[[], Any]:
    """Prepack and quantize outside the timed call; the call is the int8 kernel alone."""
    w_qp = symmetric_qparams(w.amin(dim=tuple(range(1, w.dim()))), w.amax(dim=tuple(range(1, w.dim()))), axis=0)
    in_qp = affine_qparams(x.min(), x.max(), backend.activation_qrange(feeds_grouped_conv=False))
    y = _float_call(work, x, w, b)()
    out_qp = affine_qparams(y.min(), y.max())
    a = backend.quantize(x, in_qp)
    if work.spec is None:
        packed = backend.prepack_linear(quantize_weight(w, w_qp), w_qp, b)
        return lambda: backend.linear(a, packed, in_qp, out_qp, relu=False)
    packed = backend.prepack_conv(quantize_weight(w, w_qp), w_qp, b, work.spec, in_qp=in_qp)
    return lambda: backend.conv(a, packed, in_qp, out_qp, relu=False)


def bench(work: Workload, backends: list[str], budget_s: float, threads: int | None) -> dict[str, float]:
    """Median milliseconds per call of FP32 and of every backend on ``work``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(work.x_shape, generator=gen)
    w = torch.randn(work.w_shape, generator=gen) / work.w_shape[1] ** 0.5
    b = torch.randn(work.w_shape[0], generator=gen)
    calls = {"fp32": _float_call(work, x, w, b)}
    calls.update({name: _int8_call(get_backend(name), work, x, w, b) for name in backends})
    stats = measure_latency(calls, time_budget_s=budget_s, threads=threads, max_runs=500)
    return {name: s.median for name, s in stats.items()}


def compare(label: str, fxquant: Callable[[], torch.Tensor], other: Callable[[], torch.Tensor], budget_s: float,
            threads: int | None) -> str:
    """One markdown row: ``fxquant`` and ``other`` interleaved, median [fastest-slowest] ms each, other / fxquant."""
    stats = measure_latency({"fxquant": fxquant, "other": other}, time_budget_s=budget_s, threads=threads,
                            max_runs=500)
    cells = [f"{s.median:.3f} [{s.min:.3f}-{s.max:.3f}]" for s in stats.values()]
    return f"| {label} | {' | '.join(cells)} | {stats['other'].median / stats['fxquant'].median:.2f} |"


def bench_pool(shape: tuple[int, ...], budget_s: float, threads: int | None) -> str:
    """The pool by ``channels_last_max_pool`` against the op (the same bytes, checked first)."""
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    q = q.contiguous(memory_format=torch.channels_last)
    op_arguments = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    ours, op = lambda: channels_last_max_pool(q, 2, STEM_POOL), lambda: torch.ops.quantized.max_pool2d(q, *op_arguments)
    assert torch.equal(ours(), op())
    return compare("x".join(map(str, shape)), ours, op, budget_s, threads)


def bench_norm(shape: tuple[int, ...], budget_s: float, threads: int | None) -> str:
    """``norm(a + b)`` by fxquant's step (the loop where it runs) against torch's add and LayerNorm."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    norm = nn.LayerNorm(shape[-1], eps=1e-12).requires_grad_(False)

    def ours() -> torch.Tensor:
        out = add_norm.fused(a, b, norm)
        return norm(a + b) if out is None else out

    return compare("x".join(map(str, shape)), ours, lambda: norm(a + b), budget_s, threads)


def render(rows: list[tuple[str, dict[str, float]]], backends: list[str]) -> str:
    """A markdown table: FP32 ms, then each backend's ms and its speed-up over FP32 (FP32 time / backend time)."""
    header = ["workload", "fp32 ms", *[f"{name} ms (x fp32)" for name in backends]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, ms in rows:
        cells = [label, f"{ms['fp32']:.3f}"]
        cells += [f"{ms[name]:.3f} ({ms['fp32'] / ms[name]:.2f}x)" for name in backends]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=4.0, help="seconds of timing per workload (default 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    backends = list(available_backends())
    rows = [(work.label, bench(work, backends, args.budget, args.threads)) for work in WORKLOADS]
    threads = args.threads or torch.get_num_threads()
    print(f"# int8 kernels vs FP32 — {cpu_model()}, {threads} threads, torch {torch.__version__}, ISA {isa_summary()}")
    print("(x fp32 > 1 means faster than FP32; median of interleaved runs; input already quantized)\n")
    print(render(rows, backends))
    loop = "fxquant's C loop" if native.available() else "no C loop here: the op"
    print(f"\nmax pool 3x3, stride 2, padding 1, channels-last uint8 ({loop}; ms, median [fastest-slowest])\n")
    print("| input | fxquant ms | quantized::max_pool2d ms | op / fxquant |\n|---|---|---|---|")
    for shape in POOL_SHAPES:
        print(bench_pool(shape, args.budget, args.threads))
    loop = "fxquant's C loop" if native.available("layer_norm") else "no C loop here: torch's ops on both sides"
    print(f"\nresidual add + LayerNorm, float32 ({loop}; ms, median [fastest-slowest])\n")
    print("| input | fxquant ms | torch add + LayerNorm ms | torch / fxquant |\n|---|---|---|---|")
    for shape in NORM_SHAPES:
        print(bench_norm(shape, args.budget, args.threads))


if __name__ == "__main__":
    main()

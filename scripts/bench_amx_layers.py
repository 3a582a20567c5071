"""Per-layer latency of fxquant's AMX loops (``fxquant.kernels.torch_engines.amx_conv``) against fbgemm's and qnnpack's
own kernels.

Each row times the backend's ``conv``/``linear`` on one prepacked layer twice, with the C loop and with the same
packed weight without it (the engine's op), interleaved in one :func:`fxquant.report.latency.measure_latency` run so
the ratio holds on a noisy machine. The loops run on one thread, and only up to ``native.THREAD_LIMITS`` threads;
``--threads`` sets the engines' threads. Convs need AMX (skipped without it); Linears take AMX tiles from 16 rows and
2**20 multiply-adds and the VNNI row loop below, or with VNNI but no AMX the row loop where ``NativeConv.takes``
says; with AVX2 alone, fbgemm's Linears take the AVX2 row loop within the same limits, and so do the onednn
backend's up to ``fxquant.kernels.onednn.rows.MAX_ROWS`` rows (against oneDNN's matmul primitive, which fxquant
builds for the same layer), its 3x3 convs of stride 1 take the Winograd kernel (``fxquant.kernels.onednn.winograd``)
and its depthwise 3x3 convs the depthwise loop (``fxquant.kernels.onednn.depthwise``), against oneDNN's conv
primitive. Tables: ``docs/amx.md`` and, for onednn, ``docs/backends.md``.

    python scripts/bench_amx_layers.py [--threads N] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fxquant import native
from fxquant.kernels.base import Backend, ConvSpec, PackedWeight
from fxquant.kernels.onednn import depthwise as onednn_depthwise
from fxquant.kernels.onednn import rows as onednn_rows
from fxquant.kernels.onednn import winograd as onednn_winograd
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.kernels.torch_engines.amx_conv import NativeConv
from fxquant.native.isa import cpu_model, has_amx_int8, has_avx2, isa_level
from fxquant.qparams import INT8_RANGE, UINT8_RANGE, QParams
from fxquant.report.latency import measure_latency

# (C_in, C_out, input size, kernel, stride, batch, note)
CONVS = [(3, 16, 64, 3, 1, 1, "U-Net stem"), (3, 16, 64, 3, 1, 8, ""), (32, 16, 64, 3, 1, 8, "U-Net decoder"),
         (64, 64, 16, 3, 1, 8, ""), (3, 64, 224, 7, 2, 1, "ResNet stem"), (64, 64, 56, 3, 1, 1, ""),
         (64, 64, 56, 3, 1, 8, ""), (256, 256, 14, 3, 1, 1, ""), (64, 128, 56, 1, 2, 1, ""), (16, 16, 8, 3, 1, 1, "")]
LINEARS = [(784, 256, 1), (784, 256, 8), (1024, 1024, 1), (1024, 1024, 2), (1024, 1024, 3), (1024, 1024, 4),
           (1024, 1024, 8), (1024, 1024, 16), (768, 3072, 2), (768, 3072, 4), (768, 3072, 8), (768, 768, 128),
           (768, 3072, 128), (256, 10, 8), (256, 10, 128)]
IN_QP = QParams(torch.tensor(0.02), torch.tensor(10), *UINT8_RANGE)
OUT_QP = QParams(torch.tensor(0.3), torch.tensor(100), *UINT8_RANGE)
SEVEN_BIT_QPS = (QParams(torch.tensor(0.02), torch.tensor(10), 0, 127),  # onednn's activations without VNNI
                 QParams(torch.tensor(0.3), torch.tensor(60), 0, 127))
ONEDNN_LINEARS = [(1024, 1024, rows) for rows in (1, 2, 4, 8, 16, 32, 48, 64)] + [
    (768, 3072, rows) for rows in (1, 4, 8, 16, 32, 64)] + [(3072, 768, rows) for rows in (1, 4, 8, 16, 32, 64)] + [
    (512, 1000, 1)]
# (C_in, C_out, input size, batch): ResNet-18's 3x3 layers of stride 1, then the small ones MIN_CHANNELS rests on
ONEDNN_CONVS = [(c, c, size, batch) for batch in (1, 32) for c, size in ((64, 56), (128, 28), (256, 14), (512, 7))] + [
    (3, 16, 64, 1), (16, 16, 64, 8), (24, 24, 56, 1), (16, 64, 56, 1), (32, 16, 64, 8), (32, 32, 56, 1),
    (32, 32, 112, 1), (64, 16, 56, 1)]
# MobileNetV2's depthwise layers at 224x224: (channels, input size, stride, batch)
ONEDNN_DEPTHWISE = [(32, 112, 1, 1), (96, 112, 2, 1), (144, 56, 1, 1), (144, 56, 2, 1), (192, 28, 1, 1),
                    (192, 28, 2, 1), (384, 14, 1, 1), (576, 14, 1, 1), (576, 14, 2, 1), (960, 7, 1, 1),
                    (144, 56, 1, 32), (960, 7, 1, 32)]


def _weight_qp(channels: int) -> QParams:
    return QParams(torch.rand(channels) * 0.01 + 1e-3, torch.zeros(channels, dtype=torch.long), *INT8_RANGE, axis=0)


def _conv(backend: Backend, cin: int, cout: int, size: int, k: int, stride: int,
          batch: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    weight = torch.randint(-128, 128, (cout, cin, k, k)).to(torch.int8)
    a = backend.quantize(torch.randn(batch, cin, size, size), IN_QP).contiguous(memory_format=torch.channels_last)
    spec = ConvSpec(2, (stride, stride), (k // 2, k // 2), (1, 1), 1, False, (0, 0))
    packed = backend.prepack_conv(weight, _weight_qp(cout), torch.randn(cout), spec, in_qp=IN_QP)
    op = dataclasses.replace(packed, payload=(*packed.payload[:2], None))
    return (lambda: backend.conv(a, packed, IN_QP, OUT_QP, relu=True),
            lambda: backend.conv(a, op, IN_QP, OUT_QP, relu=True))


def _linear(backend: Backend, k: int, n: int, rows: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    a = backend.quantize(torch.randn(rows, k), IN_QP)
    packed = backend.prepack_linear(torch.randint(-128, 128, (n, k)).to(torch.int8), _weight_qp(n), torch.randn(n),
                                    in_qp=IN_QP)
    op = dataclasses.replace(packed, payload=(packed.payload[0], None))
    return (lambda: backend.linear(a, packed, IN_QP, OUT_QP, relu=True),
            lambda: backend.linear(a, op, IN_QP, OUT_QP, relu=True))


def _onednn_linear(k: int, n: int, rows: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The onednn backend's Linear with the row loop, and on the same layer's primitive."""
    backend, (in_qp, out_qp) = get_backend("onednn"), SEVEN_BIT_QPS
    a = backend.quantize(torch.randn(rows, k), in_qp)
    weight, w_qp, bias = torch.randint(-128, 128, (n, k)).to(torch.int8), _weight_qp(n), torch.randn(n)
    return _onednn_pair(onednn_rows, "row_call", lambda: backend.prepack_linear(weight, w_qp, bias, in_qp=in_qp),
                        lambda packed: backend.linear(a, packed, in_qp, out_qp, relu=True))


def _onednn_conv(cin: int, cout: int, size: int, batch: int, *, depthwise: bool = False,
                 stride: int = 1) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The onednn backend's 3x3 conv (padding 1) with fxquant's loop - the Winograd kernel, or with ``depthwise`` (one
    group per channel) the depthwise loop - and on the same layer's primitive."""
    backend, (in_qp, out_qp) = get_backend("onednn"), SEVEN_BIT_QPS
    a = backend.quantize(torch.randn(batch, cin, size, size), in_qp).contiguous(memory_format=torch.channels_last)
    groups = cin if depthwise else 1
    weight = torch.randint(-128, 128, (cout, cin // groups, 3, 3)).to(torch.int8)
    w_qp, bias = _weight_qp(cout), torch.randn(cout)
    spec = ConvSpec(2, (stride, stride), (1, 1), (1, 1), groups)
    module, name = (onednn_depthwise, "depthwise_call") if depthwise else (onednn_winograd, "winograd_call")
    return _onednn_pair(module, name,
                        lambda: backend.prepack_conv(weight, w_qp, bias, spec, in_qp=in_qp),
                        lambda packed: backend.conv(a, packed, in_qp, out_qp, relu=True))


def _onednn_pair(module: Any, name: str, prepack: Callable[[], PackedWeight],
                 run: Callable[[PackedWeight], Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A onednn layer's call with fxquant's loop (``module.name`` binds it), and on the same layer's primitive,
    bound with the loop declined (the binding is made once, on the first call)."""
    packed, on_primitive = prepack(), prepack()
    declined = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: None)
    try:
        run(on_primitive)
    finally:
        setattr(module, name, declined)
    return lambda: run(packed), lambda: run(on_primitive)


def _row(label: str, pair: tuple[Callable[[], Any], Callable[[], Any]], args: argparse.Namespace) -> str:
    stats = measure_latency({"loop": pair[0], "engine": pair[1]}, time_budget_s=args.budget, threads=args.threads)
    loop, engine = stats["loop"].median * 1e3, stats["engine"].median * 1e3
    return f"| {label} | {loop:.0f} us | {engine:.0f} us | {loop / engine:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the engines' kernels")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per row")
    parser.add_argument("--ignore-thread-limits", action="store_true",
                        help="run the loops at any thread count (the measurement behind native.THREAD_LIMITS)")
    parser.add_argument("--ignore-size-limits", action="store_true",
                        help="run the loops at every size (the measurement behind NativeConv.takes, the onednn row "
                             "loop's MAX_ROWS and the Winograd conv's MIN_CHANNELS)")
    args = parser.parse_args()
    if args.ignore_thread_limits:
        native.THREAD_LIMITS.update(dict.fromkeys(native.THREAD_LIMITS, 1 << 16))
    if args.ignore_size_limits:
        NativeConv.takes = lambda self, positions: True  # type: ignore[method-assign]
        onednn_rows.MAX_ROWS = 1 << 30
        onednn_winograd.MIN_CHANNELS = 1
    if not has_avx2():
        raise SystemExit("this CPU has no AVX2: fxquant keeps the engines' kernels, nothing to compare")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"{cpu_model()}, ISA {isa_level()}; a ratio near 1.00 means both columns ran the engine's kernel")
    for engine in [e for e in ("fbgemm", "qnnpack") if e in available_backends()]:
        backend = get_backend(engine)
        print(f"\n{engine}, {args.threads} thread(s) for the engine")
        if has_amx_int8():
            _convs(backend, engine, args)
        print(f"\n| Linear, rows | C loop | {engine} | ratio |\n|---|---|---|---|")
        for k, n, rows in LINEARS:
            print(_row(f"{k} -> {n}, {rows} rows ({_linear_path(backend, k, n, rows)})", _linear(backend, k, n, rows),
                       args), flush=True)
    if "onednn" in available_backends() and onednn_rows.usable(SEVEN_BIT_QPS[0]):
        print("\n| onednn Linear, rows | AVX2 row loop | oneDNN primitive | ratio |\n|---|---|---|---|")
        for k, n, rows in ONEDNN_LINEARS:
            print(_row(f"{k} -> {n}, {rows} rows", _onednn_linear(k, n, rows), args), flush=True)
        print("\n| onednn 3x3 conv, input | Winograd | oneDNN primitive | ratio |\n|---|---|---|---|")
        for cin, cout, size, batch in ONEDNN_CONVS:
            print(_row(f"{cin} -> {cout}, {batch}x{cin}x{size}x{size}", _onednn_conv(cin, cout, size, batch), args),
                  flush=True)
        print("\n| onednn depthwise 3x3 conv, input | depthwise loop | oneDNN primitive | ratio |\n|---|---|---|---|")
        for c, size, stride, batch in ONEDNN_DEPTHWISE:
            label = f"{c} channels{' stride 2' if stride == 2 else ''}, {batch}x{c}x{size}x{size}"
            print(_row(label, _onednn_conv(c, c, size, batch, depthwise=True, stride=stride), args), flush=True)


def _linear_path(backend: Backend, k: int, n: int, rows: int) -> str:
    """What the backend runs for this Linear at this thread count: AMX tiles, the VNNI or AVX2 row loop, or the
    engine."""
    loop = backend.prepack_linear(torch.ones(n, k, dtype=torch.int8), _weight_qp(n), None, in_qp=IN_QP).payload[1]
    if loop is None or not loop.takes(rows) or not native.available(loop.family):
        return "engine"
    return "tiles" if loop.tiled(rows) else ("VNNI rows" if loop.vnni else "AVX2 rows")


def _convs(backend: Backend, engine: str, args: argparse.Namespace) -> None:
    print(f"\n| conv, input | C loop | {engine} | ratio |\n|---|---|---|---|")
    for cin, cout, size, k, stride, batch, note in CONVS:
        label = (f"{cin} -> {cout} {k}x{k}" + (f" stride {stride}" if stride > 1 else "")
                 + f", {batch}x{cin}x{size}x{size}" + (f" ({note})" if note else ""))
        print(_row(label, _conv(backend, cin, cout, size, k, stride, batch), args), flush=True)


if __name__ == "__main__":
    main()

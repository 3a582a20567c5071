"""The bundled end-to-end example: a CNN trained on scikit-learn's digits (real 8x8 images), quantized to INT8.

``fxquant demo`` trains it in seconds, prepares, calibrates and converts it, and prints FP32 vs INT8 accuracy,
latency and size.
"""

from __future__ import annotations

import time

import torch

from fxquant.api import convert, prepare
from fxquant.calibration import calibrate
from fxquant.config import QuantConfig
from fxquant.models.digits import accuracy, digits_loader, train_digits_cnn
from fxquant.report.latency import measure_latency
from fxquant.report.size import serialized_size


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_demo(*, threads: int = 1, backend: str | None = None, progress: bool = True) -> dict[str, float]:
    """Train, quantize and measure the digits CNN; print a report and return its figures."""
    start = time.perf_counter()
    model = train_digits_cnn()
    print(f"trained DigitsCNN on scikit-learn digits in {time.perf_counter() - start:.1f} s")
    calib = digits_loader("calib", batch_size=64)
    example = (next(iter(calib))[0][:1],)
    config = QuantConfig() if backend is None else QuantConfig(backend=backend)
    backend = config.backend
    prepared = prepare(model, example, config)
    summary = calibrate(prepared, calib, progress=progress)
    qmodel = convert(prepared)
    print(f"calibrated on {summary.samples} images; converted to INT8 on {backend}")
    test = digits_loader("test", batch_size=64)
    batch = next(iter(test))[0]
    lat = measure_latency({"fp32": lambda: model(batch), "int8": lambda: qmodel(batch)}, threads=threads,
                          time_budget_s=5.0)
    figures = {
        "fp32_accuracy": accuracy(model, test), "int8_accuracy": accuracy(qmodel, test),
        "fp32_ms": lat["fp32"].median, "int8_ms": lat["int8"].median,
        "fp32_bytes": serialized_size(model), "int8_bytes": serialized_size(qmodel),
    }
    print(_table([
        ("", "FP32", "INT8", "INT8 vs FP32"),
        ("test accuracy", f"{figures['fp32_accuracy']:.2%}", f"{figures['int8_accuracy']:.2%}",
         f"{(figures['int8_accuracy'] - figures['fp32_accuracy']) * 100:+.2f} pts"),
        (f"latency, batch {len(batch)}, {threads} thread(s)", f"{figures['fp32_ms']:.3f} ms",
         f"{figures['int8_ms']:.3f} ms", f"{figures['fp32_ms'] / figures['int8_ms']:.2f}x faster"),
        ("size (state dict)", f"{figures['fp32_bytes'] / 1024:.1f} KiB", f"{figures['int8_bytes'] / 1024:.1f} KiB",
         f"{figures['fp32_bytes'] / figures['int8_bytes']:.2f}x smaller"),
    ]))
    return figures


if __name__ == "__main__":
    torch.manual_seed(0)
    run_demo()

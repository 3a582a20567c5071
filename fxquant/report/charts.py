"""The report's charts, drawn with matplotlib and returned as PNG bytes.

Figures are built with ``matplotlib.figure.Figure`` and the Agg canvas, never ``pyplot``: no global figure state,
no GUI backend, safe in a headless CI job. matplotlib is imported here only, when a chart is drawn, so importing
fxquant stays light.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from fxquant.report.sections import Histogram, LayerReport

if TYPE_CHECKING:  # the schema imports the renderers
    from fxquant.report.schema import Report

FLOAT_COLOR, INT8_COLOR, ALONE_COLOR = "#7f8c8d", "#2471a3", "#e67e22"
MAX_HISTOGRAM_LAYERS = 12  # the most sensitive first; a 200-layer model would make the page unreadable


def _figure(width: float, height: float, *, layout: Literal["constrained"] | None = "constrained") -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout=layout)


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _finite(value: float | None, cap: float) -> float:
    """SQNR for a bar: a missing value is 0, an exact (infinite) one is drawn at ``cap``."""
    if value is None:
        return 0.0
    return min(value, cap) if math.isfinite(value) or value > 0 else 0.0


def sqnr_chart(layers: Sequence[LayerReport]) -> bytes:
    """Horizontal bars: each layer's output SQNR in the quantized model and alone; low bars are the problems."""
    measured = [layer for layer in layers if layer.sqnr_db is not None]
    finite = [v for layer in measured for v in (layer.sqnr_db, layer.isolated_sqnr_db)
              if v is not None and math.isfinite(v)]
    cap = max(finite, default=60.0) * 1.1 or 1.0
    fig = _figure(8, 1.5 + 0.32 * max(1, len(measured)))
    ax = fig.add_subplot()
    positions = range(len(measured))
    names = [f"{layer.name}{'' if layer.quantized else ' (float)'}" for layer in measured]
    ax.barh([p - 0.2 for p in positions], [_finite(layer.sqnr_db, cap) for layer in measured], height=0.4,
            color=INT8_COLOR, label="output in the quantized model")
    ax.barh([p + 0.2 for p in positions], [_finite(layer.isolated_sqnr_db, cap) for layer in measured],
            height=0.4, color=ALONE_COLOR, label="layer alone (float input)")
    ax.set_yticks(list(positions), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("SQNR (dB, higher is better)")
    ax.set_title("Per-layer output SQNR")
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    return _png(fig)


def latency_chart(report: Report) -> bytes:
    """One panel per batch size (each on its own scale): median float vs int8, whiskers up to p90, speed-up."""
    points = report.latency.points
    fig = _figure(min(10.0, 2.2 + 2.6 * len(points)), 3.4)
    axes = fig.subplots(1, len(points), squeeze=False)[0]
    for ax, point in zip(axes, points, strict=True):
        stats = (point.float_ms, point.quantized_ms)
        ax.bar(["float", "int8"], [s.median for s in stats], color=[FLOAT_COLOR, INT8_COLOR],
               yerr=[[0.0, 0.0], [s.p90 - s.median for s in stats]], capsize=4)
        ax.set_title(f"batch {point.batch_size}: {point.speedup:.2f}x", fontsize=9)
        ax.tick_params(labelsize=8)
    axes[0].set_ylabel("ms per call (median, whisker: p90)", fontsize=8)
    fig.suptitle(f"Latency, {report.latency.threads} thread(s), float and int8 interleaved", fontsize=10)
    return _png(fig)


def _draw_histogram(ax: Any, hist: Histogram, color: str, title: str) -> None:
    width = (hist.high - hist.low) / max(1, len(hist.counts))
    edges = [hist.low + i * width for i in range(len(hist.counts) + 1)]
    ax.stairs(hist.counts, edges, fill=True, color=color)
    ax.set_yscale("symlog")
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=7)


def histogram_chart(report: Report) -> bytes | None:
    """Weight and output value histograms of the most sensitive layers; dashed lines: the int8 output range."""
    ranked = report.ranking() or [layer for layer in report.layers if layer.weight_histogram is not None]
    layers = [layer for layer in ranked if layer.weight_histogram or layer.activation_histogram]
    layers = layers[:MAX_HISTOGRAM_LAYERS]
    if not layers:
        return None
    height = 0.8 + 1.9 * len(layers)
    fig = _figure(8, height, layout=None)  # a layout engine costs seconds on a dozen axes: fixed margins instead
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.35 / height, top=1 - 0.6 / height, hspace=0.6, wspace=0.15)
    axes = fig.subplots(len(layers), 2, squeeze=False)
    for row, layer in zip(axes, layers, strict=True):
        if layer.weight_histogram is not None:
            _draw_histogram(row[0], layer.weight_histogram, FLOAT_COLOR, f"{layer.name}: weights")
        if layer.activation_histogram is not None:
            _draw_histogram(row[1], layer.activation_histogram, INT8_COLOR, f"{layer.name}: outputs")
        if layer.quant_range is not None:
            for edge in layer.quant_range:
                row[1].axvline(edge, color="#c0392b", linestyle="--", linewidth=1)
    fig.suptitle("Value ranges (log counts); dashed: representable int8 output range", fontsize=9)
    return _png(fig)

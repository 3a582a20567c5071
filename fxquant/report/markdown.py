"""Render a report as GitHub-flavoured Markdown tables that paste into a pull request."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fxquant.report.sections import Accuracy, LayerReport

if TYPE_CHECKING:  # the schema imports the renderers
    from fxquant.report.schema import Report

_RANKED = 5  # the most sensitive layers listed under the tables


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; ``|`` in cells is escaped so a layer name cannot break the columns."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|", *(line(r) for r in rows)])


def fmt_db(value: float | None) -> str:
    if value is None:
        return "-"
    return "exact" if math.isinf(value) and value > 0 else f"{value:.1f} dB"


def fmt_metric(accuracy: Accuracy, value: float) -> str:
    return f"{value:.2%}" if accuracy.points_per_unit == 100 else f"{value:.4g}"


def fmt_change(accuracy: Accuracy) -> str:
    """The quantized metric minus the float one, in points (percentage points for top-k): negative is worse."""
    unit = " pts" if accuracy.points_per_unit == 100 else ""
    change = accuracy.quantized_value - accuracy.float_value
    return f"{change * accuracy.points_per_unit:+.2f}{unit}"


def fmt_isa(isa: Mapping[str, bool]) -> str:
    return ", ".join(name for name, present in isa.items() if present) or "no VNNI/AMX"


def fmt_ratio(ratio: float, better: str, worse: str) -> str:
    """``2.00x faster`` for a ratio of 2, ``1.25x slower`` for 0.8: a ratio below 1 reads wrong as "0.80x faster"."""
    if ratio <= 0:
        return "-"
    return f"{ratio:.2f}x {better}" if ratio >= 1 else f"{1 / ratio:.2f}x {worse}"


def fmt_bytes(size: int) -> str:
    return f"{size / 1024:.1f} KiB" if size < 1024**2 else f"{size / 1024**2:.2f} MiB"


def _summary(report: Report) -> str:
    acc, size = report.accuracy, report.size
    rows = [[f"{acc.metric} ({acc.samples} samples)", fmt_metric(acc, acc.float_value),
             fmt_metric(acc, acc.quantized_value), fmt_change(acc)]]
    head = report.latency.headline
    rows.append([f"latency median, batch {head.batch_size}, {report.latency.threads} thread(s)",
                 f"{head.float_ms.median:.3f} ms", f"{head.quantized_ms.median:.3f} ms",
                 fmt_ratio(head.speedup, "faster", "slower")])
    ratio = size.float_bytes / size.quantized_bytes if size.quantized_bytes else 0.0
    rows.append(["size (state dict)", fmt_bytes(size.float_bytes), fmt_bytes(size.quantized_bytes),
                 fmt_ratio(ratio, "smaller", "larger")])
    if report.fidelity is not None:
        fid = report.fidelity
        rows.append(["output fidelity", "reference", f"SQNR {fmt_db(fid.sqnr_db)}, cos {fid.cosine_similarity:.4f}",
                     f"max abs err {fid.max_abs_error:.3g}"])
    return table(["", "float", "int8", "int8 vs float"], rows)


def _latency(report: Report) -> str:
    rows = [[str(p.batch_size), f"{p.float_ms.median:.3f}", f"{p.float_ms.p90:.3f}", f"{p.quantized_ms.median:.3f}",
             f"{p.quantized_ms.p90:.3f}", f"{p.speedup:.2f}x"] for p in report.latency.points]
    return table(["batch", "float median ms", "float p90 ms", "int8 median ms", "int8 p90 ms", "speed-up"], rows)


def _range(pair: tuple[float, float] | None) -> str:
    return "-" if pair is None else f"[{pair[0]:.3g}, {pair[1]:.3g}]"


def _layer_row(layer: LayerReport) -> list[str]:
    return [f"`{layer.name}`", layer.kind, "int8" if layer.quantized else "float", layer.backend,
            fmt_db(layer.sqnr_db), fmt_db(layer.isolated_sqnr_db), _range(layer.weight_range),
            _range(layer.activation_range), layer.reason or ""]


def _alone_or_in_model(layer: LayerReport) -> float | None:
    return layer.isolated_sqnr_db if layer.isolated_sqnr_db is not None else layer.sqnr_db


def _layers(report: Report) -> str:
    header = ["layer", "kind", "runs as", "backend", "SQNR (in model)", "SQNR (alone)", "weight range",
              "output range", "note"]
    if not report.layers:
        return ("No per-layer rows: they need the float model to trace as a whole, and this one runs as INT8 "
                "islands inside its own code (`fxquant.coverage(qmodel, *inputs)` lists every layer).")
    lines = [table(header, [_layer_row(layer) for layer in report.layers])]
    ranked = report.ranking()[:_RANKED]
    if ranked:
        names = ", ".join(f"`{layer.name}` ({fmt_db(_alone_or_in_model(layer))})" for layer in ranked)
        lines.append(f"\nMost sensitive layers (lowest SQNR alone first): {names}")
    return "\n".join(lines)


def _environment(report: Report) -> str:
    env = report.environment
    if env is None:
        return ""
    return (f"torch {env.torch}, fxquant {env.fxquant}, Python {env.python}; CPU: {env.cpu} ({fmt_isa(env.isa)}); "
            f"backend {env.backend}, {env.threads} thread(s); observer {env.observer}, weights {env.weight}, "
            f"{env.calibration_samples} calibration samples" + (f"; oneDNN: {env.onednn}" if env.onednn else ""))


def render_markdown(report: Report) -> str:
    """The whole report: summary, latency per batch size, per-layer table, the accuracy-budget search's trials (when
    one chose the model), environment line."""
    parts = [f"## fxquant report: {report.backend}, observer {report.observer}", _summary(report),
             "### Latency", _latency(report), "### Layers", _layers(report)]
    if report.budget_search is not None:
        parts += ["### Accuracy-budget search (every trial)", report.budget_search.to_markdown()]
    env = _environment(report)
    if env:
        parts += ["### Environment", env]
    return "\n\n".join(parts) + "\n"

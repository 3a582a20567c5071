"""Render a report as one self-contained HTML file: tables plus matplotlib charts inlined as base64 PNG.

Self-contained means no script, stylesheet or image is fetched: the file can be attached to a CI run or mailed and
still shows everything. All text from the model (layer names) is escaped.
"""

from __future__ import annotations

import base64
import html
from typing import TYPE_CHECKING

from fxquant.report.charts import histogram_chart, latency_chart, sqnr_chart
from fxquant.report.markdown import fmt_bytes, fmt_change, fmt_db, fmt_isa, fmt_metric, fmt_ratio

if TYPE_CHECKING:  # the schema imports the renderers
    from fxquant.report.schema import Report

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f2f4f4}.bad{color:#c0392b;font-weight:bold}figure{margin:1.5em 0}img{max-width:100%}
figcaption{font-size:13px;color:#555}
"""


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _image(png: bytes | None, alt: str, caption: str) -> str:
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _summary(report: Report) -> str:
    acc, head, size = report.accuracy, report.latency.headline, report.size
    rows = [
        [html.escape(acc.metric), fmt_metric(acc, acc.float_value), fmt_metric(acc, acc.quantized_value),
         fmt_change(acc)],
        [f"latency (batch {head.batch_size})", f"{head.float_ms.median:.3f} ms", f"{head.quantized_ms.median:.3f} ms",
         fmt_ratio(head.speedup, "faster", "slower")],
        ["size", fmt_bytes(size.float_bytes), fmt_bytes(size.quantized_bytes),
         fmt_ratio(size.float_bytes / max(1, size.quantized_bytes), "smaller", "larger")],
    ]
    if report.fidelity is not None:
        fid = report.fidelity
        rows.append(["output fidelity", "reference", f"SQNR {fmt_db(fid.sqnr_db)}",
                     f"cosine {fid.cosine_similarity:.4f}, max abs error {fid.max_abs_error:.3g}"])
    return _table(["", "float", "int8", "int8 vs float"], rows)


def _layers(report: Report) -> str:
    ranked = {layer.name: i + 1 for i, layer in enumerate(report.ranking())}
    rows = []
    for layer in report.layers:
        rank = ranked.get(layer.name)
        cls = ' class="bad"' if rank == 1 else ""
        rows.append([f"<code{cls}>{html.escape(layer.name)}</code>", html.escape(layer.kind),
                     "int8" if layer.quantized else "float", html.escape(layer.backend), fmt_db(layer.sqnr_db),
                     fmt_db(layer.isolated_sqnr_db), str(rank or "-"), html.escape(layer.reason)])
    return _table(["layer", "kind", "runs as", "backend", "SQNR in model", "SQNR alone", "sensitivity rank",
                   "note"], rows)


def _budget_search(report: Report) -> str:
    search = report.budget_search
    if search is None:
        return ""
    rows = [[html.escape(cell) for cell in row] for row in search.rows()]
    return (f"<h2>Accuracy-budget search (every trial)</h2><p>{html.escape(search.summary())}</p>"
            f"{_table(search.header(), rows)}<p>{html.escape(search.verdict())}</p>")


def _environment(report: Report) -> str:
    env = report.environment
    if env is None:
        return ""
    values = {**env.to_dict(), "isa": fmt_isa(env.isa)}
    rows = [[html.escape(key), html.escape(str(value))] for key, value in values.items()]
    return "<h2>Environment</h2>" + _table(["", ""], rows)


def render_html(report: Report) -> str:
    """The full page: summary, SQNR bar chart, latency chart, range histograms, layer table, environment."""
    title = f"fxquant report: {report.backend}, observer {report.observer}"
    parts = [
        f"<h1>{html.escape(title)}</h1>", "<h2>Summary</h2>", _summary(report),
        "<h2>Per-layer SQNR</h2>",
        _image(sqnr_chart(report.layers), "per-layer SQNR bar chart",
               "Blue: the layer's output in the quantized model vs the float model (earlier errors included). "
               "Orange: the quantized layer alone on the float layer's input (its own error)."),
        "<h2>Latency</h2>",
        _image(latency_chart(report), "latency comparison chart",
               "Float and int8 measured interleaved in one run; bars: median, whiskers: p90."),
        "<h2>Value ranges</h2>",
        _image(histogram_chart(report), "range histograms",
               "Weight and output histograms of the most sensitive layers."),
        "<h2>Layers</h2>", _layers(report), _budget_search(report), _environment(report),
    ]
    body = "\n".join(p for p in parts if p)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n")

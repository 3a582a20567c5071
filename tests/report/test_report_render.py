"""Renderers: Markdown tables keep their shape, the HTML page is self-contained and holds the matplotlib charts."""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path

from report_helpers import API_EXAMPLE, digits_report

from fxquant.report.schema import Report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tables(markdown: str) -> list[list[str]]:
    """Each block of consecutive lines starting with ``|``."""
    tables: list[list[str]] = []
    previous = False
    for line in markdown.splitlines():
        is_row = line.startswith("|")
        if is_row and not previous:
            tables.append([])
        if is_row:
            tables[-1].append(line)
        previous = is_row
    return tables


def _cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row)) - 2


def test_markdown_tables_have_a_consistent_shape() -> None:
    text = digits_report().to_markdown()
    tables = _tables(text)
    assert len(tables) == 3  # summary, latency per batch size, layers
    for table in tables:
        assert re.fullmatch(r"\|(---\|)+", table[1]), table[1]
        assert len({_cells(row) for row in table}) == 1, table
    summary, latency, layers = tables
    assert summary[2].startswith("| top1 (360 samples) |")
    assert len(latency) == 2 + 2  # header, rule, batch 1, batch 8
    assert len(layers) == 2 + len(digits_report().layers)
    assert "| `fc2` | Linear | float | float |" in text and "excluded by config" in text
    assert "Most sensitive layers" in text and "avx512_vnni" not in text.split("### Environment")[0]


def test_markdown_escapes_pipes_in_layer_names() -> None:
    data = copy.deepcopy(API_EXAMPLE)
    data["layers"][0]["name"] = "a|b"
    table = _tables(Report.from_dict(data).to_markdown())[-1]
    assert len({_cells(row) for row in table}) == 1


def test_html_is_one_file_with_the_charts_inline(tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    text = digits_report().to_html(path)
    assert path.read_text() == text and text.startswith("<!DOCTYPE html>")
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', text)
    assert [alt for alt, _ in images] == ["per-layer SQNR bar chart", "latency comparison chart", "range histograms"]
    for _, data in images:
        assert base64.b64decode(data).startswith(PNG_MAGIC)
    for title in ("Summary", "Per-layer SQNR", "Latency", "Value ranges", "Layers", "Environment"):
        assert f"<h2>{title}</h2>" in text
    assert not re.search(r'(src|href)="(https?:)?//', text)  # nothing fetched from elsewhere
    assert "<script" not in text


def test_html_escapes_layer_names_and_renders_reports_read_from_json() -> None:
    data = copy.deepcopy(API_EXAMPLE)
    data["layers"][0]["name"] = "<b>features.0</b>"
    text = Report.from_dict(data).to_html()
    assert "&lt;b&gt;features.0&lt;/b&gt;" in text and "<b>features.0</b>" not in text
    assert text.count("data:image/png;base64,") == 2  # no histograms without per-layer ranges

"""``Report``: what :func:`fxquant.report` measured, versioned for JSON and rendered as Markdown or HTML.

The JSON form (``schema_version`` 1) is the contract CI baselines rely on: the keys listed in the public API page
are always written and are the only ones required when reading; everything else (fidelity, per-batch-size latency,
per-layer ranges and histograms, environment) is an extra that readers may ignore. A report from an unknown schema
version is refused with ``ArtifactError`` rather than misread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fxquant.errors import ArtifactError
from fxquant.report._validate import items, read, section
from fxquant.report.sections import Accuracy, Environment, Fidelity, Latency, LayerReport, Size
from fxquant.report.trials import BudgetTrials

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Report:
    """Accuracy, output fidelity, latency, size and per-layer error of a quantized model against its float model.

    Example::

        report = fxquant.report(model, qmodel, test_loader, metric="top1")
        print(report.to_markdown())
        report.to_json("report.json")
        report.to_html("report.html")
    """

    schema_version: ClassVar[int] = SCHEMA_VERSION

    backend: str
    observer: str
    accuracy: Accuracy
    latency: Latency
    size: Size
    layers: tuple[LayerReport, ...]
    fidelity: Fidelity | None = None
    environment: Environment | None = None
    budget_search: BudgetTrials | None = None  # the accuracy-budget search's trials, when one chose the model

    def ranking(self) -> list[LayerReport]:
        """Quantized layers from most to least sensitive: lowest isolated SQNR first (cumulative if absent)."""
        def key(layer: LayerReport) -> float:
            value = layer.isolated_sqnr_db if layer.isolated_sqnr_db is not None else layer.sqnr_db
            return math.inf if value is None else value

        measured = [layer for layer in self.layers if layer.quantized and
                    (layer.isolated_sqnr_db is not None or layer.sqnr_db is not None)]
        return sorted(measured, key=key)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (schema version 1); infinite SQNRs (exact outputs) are written as ``null``."""
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION, "backend": self.backend, "observer": self.observer,
            "accuracy": self.accuracy.to_dict(), "latency_ms": self.latency.to_dict(),
            "size_bytes": self.size.to_dict(), "layers": [layer.to_dict() for layer in self.layers],
            "sensitivity_ranking": [layer.name for layer in self.ranking()],
        }
        if self.fidelity is not None:
            data["fidelity"] = self.fidelity.to_dict()
        if self.environment is not None:
            data["environment"] = self.environment.to_dict()
        if self.budget_search is not None:
            data["budget_search"] = self.budget_search.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "report") -> Report:
        """Read and validate a report dict; ``ArtifactError`` names the offending key and ``source``."""
        if not isinstance(data, Mapping):
            raise ArtifactError(f"{source}: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise ArtifactError(f"{source}: unsupported report schema_version {version!r}; this fxquant reads "
                                f"version {SCHEMA_VERSION}. Regenerate the report with this fxquant version.")
        try:
            return cls._parse(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{source}: {exc}") from None

    @classmethod
    def _parse(cls, data: Mapping[str, Any]) -> Report:
        def part(key: str) -> Mapping[str, Any]:
            value = section(data, key, "report")
            assert value is not None
            return value

        fidelity = section(data, "fidelity", "report", required=False)
        environment = section(data, "environment", "report", required=False)
        search = section(data, "budget_search", "report", required=False)
        layers = items(data, "layers", "report")
        return cls(
            backend=read(data, "backend", str, "report"), observer=read(data, "observer", str, "report"),
            accuracy=Accuracy.from_dict(part("accuracy")), latency=Latency.from_dict(part("latency_ms")),
            size=Size.from_dict(part("size_bytes")),
            layers=tuple(LayerReport.from_dict(layer, f"layers[{i}]") for i, layer in enumerate(layers)),
            fidelity=None if fidelity is None else Fidelity.from_dict(fidelity),
            environment=None if environment is None else Environment.from_dict(environment),
            budget_search=None if search is None else BudgetTrials.from_dict(search),
        )

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as strict JSON text (no NaN/Infinity), written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> Report:
        """Read a report from a JSON file path (or JSON text starting with ``{``)."""
        text, name = _json_text(source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{name}: not valid JSON ({exc}); is it a report written by to_json()?") from None
        return cls.from_dict(data, source=name)

    def to_markdown(self) -> str:
        """Markdown tables (summary, latency, layers, environment) that paste into a pull request."""
        from fxquant.report.markdown import render_markdown

        return render_markdown(self)

    def to_html(self, path: str | Path | None = None) -> str:
        """One self-contained HTML page with matplotlib charts inlined as PNG; written to ``path`` when given."""
        from fxquant.report.html import render_html

        text = render_html(self)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


def _json_text(source: str | Path) -> tuple[str, str]:
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return source, "report JSON"
    path = Path(source)
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot read the report ({exc.__class__.__name__}: {exc})") from None

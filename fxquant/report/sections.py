"""The parts of a :class:`~fxquant.report.schema.Report`: frozen dataclasses, each with ``to_dict``/``from_dict``.

Each ``to_dict`` writes the keys of the Report JSON schema (see docs/report.md) and each ``from_dict`` reads them
back, requiring only the keys the schema fixes (so reports from other producers still load) and raising
``ArtifactError`` naming the JSON path of anything malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fxquant.report._validate import (
    finite_or_none,
    items,
    number,
    number_pair,
    optional_number,
    read,
    section,
)
from fxquant.report.latency import LatencyStats

TOPK_POINTS = 100.0  # top-k accuracies are fractions; their drops are compared in percentage points


@dataclass(frozen=True)
class Accuracy:
    """The task metric on the float and the quantized model, reduced over the same data."""

    metric: str
    float_value: float
    quantized_value: float
    samples: int = 0
    higher_is_better: bool = True
    points_per_unit: float = 1.0  # 100 for top-k fractions: gate limits are given in percentage points

    @property
    def drop(self) -> float:
        """How much worse the quantized model is, in metric units (negative: it is better)."""
        delta = self.float_value - self.quantized_value
        return delta if self.higher_is_better else -delta

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "float": self.float_value, "quantized": self.quantized_value,
                "drop": self.drop, "samples": self.samples, "higher_is_better": self.higher_is_better,
                "points_per_unit": self.points_per_unit}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "accuracy") -> Accuracy:
        metric = read(data, "metric", str, where)
        number(data, "drop", where)  # required by the schema; recomputed from the two values
        default_points = TOPK_POINTS if metric in ("top1", "top5") else 1.0
        return cls(metric, number(data, "float", where), number(data, "quantized", where),
                   int(number(data, "samples", where, 0.0)), bool(data.get("higher_is_better", True)),
                   number(data, "points_per_unit", where, default_points))


@dataclass(frozen=True)
class Fidelity:
    """How close the quantized model's outputs are to the float model's, over every output element."""

    sqnr_db: float
    cosine_similarity: float
    max_abs_error: float
    samples: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"sqnr_db": finite_or_none(self.sqnr_db), "cosine_similarity": self.cosine_similarity,
                "max_abs_error": self.max_abs_error, "samples": self.samples}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "fidelity") -> Fidelity:
        return cls(number(data, "sqnr_db", where), number(data, "cosine_similarity", where),
                   number(data, "max_abs_error", where), int(number(data, "samples", where, 0.0)))


def _stats(data: Mapping[str, Any], key: str, where: str) -> LatencyStats:
    stats = section(data, key, where)
    assert stats is not None
    where = f"{where}.{key}"
    return LatencyStats.from_numbers(number(stats, "median", where), number(stats, "p90", where), stats)


@dataclass(frozen=True)
class LatencyPoint:
    """Float and quantized latency at one batch size, measured interleaved in one run."""

    batch_size: int
    float_ms: LatencyStats
    quantized_ms: LatencyStats

    @property
    def speedup(self) -> float:
        """Float median / quantized median: > 1 means the quantized model is faster."""
        return self.float_ms.median / self.quantized_ms.median if self.quantized_ms.median > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "float": self.float_ms.to_dict(),
                "quantized": self.quantized_ms.to_dict(), "speedup": self.speedup}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> LatencyPoint:
        return cls(int(number(data, "batch_size", where, 0.0)), _stats(data, "float", where),
                   _stats(data, "quantized", where))


@dataclass(frozen=True)
class Latency:
    """Latency at each configured batch size; the first one is the headline (the schema's top-level keys)."""

    points: tuple[LatencyPoint, ...]
    threads: int = 0

    @property
    def headline(self) -> LatencyPoint:
        return self.points[0]

    def to_dict(self) -> dict[str, Any]:
        head = self.headline.to_dict()
        return {**head, "threads": self.threads, "by_batch_size": [p.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "latency_ms") -> Latency:
        number(data, "speedup", where)  # required by the schema; recomputed from the medians
        head = LatencyPoint.from_dict(data, where)
        rows = items(data, "by_batch_size", where) if "by_batch_size" in data else []
        points = tuple(LatencyPoint.from_dict(row, f"{where}.by_batch_size[{i}]") for i, row in enumerate(rows))
        return cls(points or (head,), int(number(data, "threads", where, 0.0)))


@dataclass(frozen=True)
class Size:
    """Bytes of the serialized state dicts (what a deployment ships)."""

    float_bytes: int
    quantized_bytes: int

    def to_dict(self) -> dict[str, Any]:
        ratio = self.float_bytes / self.quantized_bytes if self.quantized_bytes else 0.0
        return {"float": self.float_bytes, "quantized": self.quantized_bytes, "ratio": ratio}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "size_bytes") -> Size:
        return cls(int(number(data, "float", where)), int(number(data, "quantized", where)))


@dataclass(frozen=True)
class Histogram:
    """Equal-width bin counts between ``low`` and ``high``: enough to redraw a range plot from the JSON alone."""

    low: float
    high: float
    counts: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"min": self.low, "max": self.high, "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, where: str) -> Histogram | None:
        if data is None:
            return None
        counts = items(data, "counts", where)
        return cls(number(data, "min", where), number(data, "max", where), tuple(int(c) for c in counts))


@dataclass(frozen=True)
class LayerReport:
    """One float Linear/Conv and what quantization did to it.

    ``sqnr_db`` is its output in the quantized model against the float model on the same inputs (errors of earlier
    layers included); ``isolated_sqnr_db`` feeds the quantized layer the float layer's own input, so it measures the
    error this layer adds by itself and is what the sensitivity ranking sorts on. None: not measured; inf: exact.
    """

    name: str
    quantized: bool
    kind: str = ""
    reason: str = ""
    backend: str = ""
    sqnr_db: float | None = None
    isolated_sqnr_db: float | None = None
    weight_sqnr_db: float | None = None
    weight_range: tuple[float, float] | None = None
    activation_range: tuple[float, float] | None = None
    quant_range: tuple[float, float] | None = None
    weight_histogram: Histogram | None = None
    activation_histogram: Histogram | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "quantized": self.quantized, "kind": self.kind,
                                "backend": self.backend}
        if self.reason:
            data["reason"] = self.reason
        for key in ("sqnr_db", "isolated_sqnr_db", "weight_sqnr_db"):
            value = getattr(self, key)
            if value is not None:
                data[key] = finite_or_none(value)
        for key in ("weight_range", "activation_range", "quant_range"):
            pair = getattr(self, key)
            if pair is not None:
                data[key] = list(pair)
        for key in ("weight_histogram", "activation_histogram"):
            hist = getattr(self, key)
            if hist is not None:
                data[key] = hist.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> LayerReport:
        def hist(key: str) -> Histogram | None:
            return Histogram.from_dict(section(data, key, where, required=False), f"{where}.{key}")

        def sqnr(key: str) -> float | None:
            return optional_number(data, key, where)

        def pair(key: str) -> tuple[float, float] | None:
            return number_pair(data, key, where)

        return cls(
            read(data, "name", str, where), read(data, "quantized", bool, where), kind=str(data.get("kind", "")),
            reason=str(data.get("reason", "")), backend=str(data.get("backend", "")), sqnr_db=sqnr("sqnr_db"),
            isolated_sqnr_db=sqnr("isolated_sqnr_db"), weight_sqnr_db=sqnr("weight_sqnr_db"),
            weight_range=pair("weight_range"), activation_range=pair("activation_range"),
            quant_range=pair("quant_range"), weight_histogram=hist("weight_histogram"),
            activation_histogram=hist("activation_histogram"),
        )


@dataclass(frozen=True)
class Environment:
    """Where and how the numbers were measured: without it, a latency figure cannot be compared with another."""

    torch: str = ""
    fxquant: str = ""
    python: str = ""
    cpu: str = ""
    isa: Mapping[str, bool] = field(default_factory=dict)
    backend: str = ""
    threads: int = 0
    observer: str = ""
    weight: str = ""
    calibration_samples: int = 0
    onednn: str = ""  # the oneDNN the onednn backend called directly, or why it ran the torch ops (onednn_direct)

    def to_dict(self) -> dict[str, Any]:
        return {"torch": self.torch, "fxquant": self.fxquant, "python": self.python, "cpu": self.cpu,
                "isa": dict(self.isa), "backend": self.backend, "threads": self.threads, "observer": self.observer,
                "weight": self.weight, "calibration_samples": self.calibration_samples, "onednn": self.onednn}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "environment") -> Environment:
        isa = section(data, "isa", where, required=False) or {}
        texts = {k: str(data.get(k, "")) for k in ("torch", "fxquant", "python", "cpu", "backend", "observer",
                                                   "weight", "onednn")}
        return cls(isa={str(k): bool(v) for k, v in isa.items()}, threads=int(number(data, "threads", where, 0.0)),
                   calibration_samples=int(number(data, "calibration_samples", where, 0.0)), **texts)

"""Measurements of float vs quantized models: latency, size (and, as they land, accuracy and per-layer error)."""

from fxquant.report.latency import LatencyStats, measure_latency
from fxquant.report.size import serialized_size

__all__ = ["LatencyStats", "measure_latency", "serialized_size"]

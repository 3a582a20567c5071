"""Measurements of float vs quantized models: accuracy, output fidelity, latency, size, per-layer error, and the
regression gate that compares reports release to release.

``fxquant.report`` (the attribute of the top-level package) is the :func:`~fxquant.report.build.report` function;
the modules of this package stay importable as ``from fxquant.report.<module> import ...``.
"""

from fxquant.report.build import report
from fxquant.report.latency import LatencyStats, measure_latency
from fxquant.report.regress import Result, assert_no_regression, compare
from fxquant.report.schema import SCHEMA_VERSION, Report
from fxquant.report.size import serialized_size

__all__ = [
    "SCHEMA_VERSION",
    "LatencyStats",
    "Report",
    "Result",
    "assert_no_regression",
    "compare",
    "measure_latency",
    "report",
    "serialized_size",
]

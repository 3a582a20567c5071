"""Measurements of float vs quantized models: accuracy, output fidelity, latency, size, per-layer error, and the
regression gate that compares reports release to release.

``fxquant.report`` is both this package and the function of the public API: calling the package calls
:func:`~fxquant.report.build.report` (``fxquant.report(model, qmodel, data)``), and its names stay attributes
(``fxquant.report.Report``, ``fxquant.report.latency``). One object, so neither shadows the other.
"""

import inspect
import sys
import types
from typing import Any

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


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Report:
        return report(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
__signature__ = inspect.signature(report)  # what inspect.signature(fxquant.report) shows

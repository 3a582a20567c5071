"""fxquant: post-training INT8 quantization of PyTorch models on CPU, built on torch.fx.

Importing fxquant has no side effects: no engine switch, no heavy optional imports.
"""

from fxquant import (
    errors,
    report,  # a package that is also the report() function (fxquant/report/__init__.py)
)
from fxquant._version import __version__
from fxquant.api import convert, prepare, recompute_qparams
from fxquant.artifacts import export, load, save
from fxquant.calibration import CalibrationSummary, calibrate, observing
from fxquant.config import QuantConfig
from fxquant.inspect.coverage import coverage
from fxquant.inspect.graph import format_graph, print_graph
from fxquant.observers import register_observer
from fxquant.report.regress import assert_no_regression
from fxquant.tuning.quantize import quantize

__all__ = [
    "CalibrationSummary",
    "QuantConfig",
    "__version__",
    "assert_no_regression",
    "calibrate",
    "convert",
    "coverage",
    "errors",
    "export",
    "format_graph",
    "load",
    "observing",
    "prepare",
    "print_graph",
    "quantize",
    "recompute_qparams",
    "register_observer",
    "report",
    "save",
]

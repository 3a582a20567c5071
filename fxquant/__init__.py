"""fxquant: post-training INT8 quantization of PyTorch models on CPU, built on torch.fx.

Importing fxquant has no side effects: no engine switch, no heavy optional imports.
"""

from fxquant import errors
from fxquant._version import __version__
from fxquant.api import convert, prepare, quantize, recompute_qparams
from fxquant.artifacts import export, load, save
from fxquant.calibration import CalibrationSummary, calibrate, observing
from fxquant.config import QuantConfig
from fxquant.inspect.coverage import coverage
from fxquant.inspect.graph import format_graph, print_graph
from fxquant.observers import register_observer
from fxquant.report.build import (
    report,  # binds `fxquant.report` to the function; `fxquant.report.<module>` still imports
)
from fxquant.report.regress import assert_no_regression

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

"""fxquant: post-training INT8 quantization of PyTorch models on CPU, built on torch.fx.

Importing fxquant has no side effects: no engine switch, no heavy optional imports.
"""

from fxquant import errors
from fxquant.api import convert, prepare, quantize, recompute_qparams
from fxquant.calibration import CalibrationSummary, calibrate, observing
from fxquant.config import QuantConfig
from fxquant.graph_view import format_graph, print_graph
from fxquant.observers import register_observer

__version__ = "0.1.0"

__all__ = [
    "CalibrationSummary",
    "QuantConfig",
    "__version__",
    "calibrate",
    "convert",
    "errors",
    "format_graph",
    "observing",
    "prepare",
    "print_graph",
    "quantize",
    "recompute_qparams",
    "register_observer",
]

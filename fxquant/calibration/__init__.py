"""Calibration: the loop, the ``observing`` context, data adapters, diagnostics, checkpoints, distributed merge."""

from fxquant.calibration.adapters import iterate_batches
from fxquant.calibration.checkpoint import load_checkpoint, save_checkpoint
from fxquant.calibration.diagnostics import ChannelSpread, SparseObserver
from fxquant.calibration.distributed import merge_across_ranks
from fxquant.calibration.loop import calibrate
from fxquant.calibration.observing import observers_of, observing
from fxquant.calibration.summary import CalibrationSummary

__all__ = [
    "CalibrationSummary",
    "ChannelSpread",
    "SparseObserver",
    "calibrate",
    "iterate_batches",
    "load_checkpoint",
    "merge_across_ranks",
    "observers_of",
    "observing",
    "save_checkpoint",
]

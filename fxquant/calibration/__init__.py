"""Calibration: the loop, the ``observing`` context and the data adapters."""

from fxquant.calibration.loop import CalibrationSummary, calibrate
from fxquant.calibration.observing import observers_of, observing

__all__ = ["CalibrationSummary", "calibrate", "observers_of", "observing"]

"""Exception types raised by fxquant.

Every error a user can cause derives from :class:`FxQuantError`, so callers (and the CLI, which maps them to exit
code 2) can tell bad input apart from a bug. Messages say what failed, where, what was received and how to fix it.
"""

from __future__ import annotations

from typing import Any


class FxQuantError(Exception):
    """Base class of every error caused by the user's model, data, configuration or files."""


class ConfigError(FxQuantError, ValueError):
    """A configuration value or key is invalid (unknown observer, typo in a key, bad pattern...)."""


class TraceError(FxQuantError):
    """torch.fx could not trace the model (or a part of it); ``failure`` says where (a ``GraphBreak``)."""

    def __init__(self, message: str, *, failure: Any = None) -> None:
        super().__init__(message)
        self.failure = failure


class CalibrationError(FxQuantError):
    """Calibration is missing, incomplete, or saw data that would produce a wrong model (NaN/Inf)."""


class BackendUnavailableError(FxQuantError):
    """The requested kernel backend does not exist in this torch build or on this CPU."""


class ArtifactError(FxQuantError):
    """A saved artifact is missing, corrupt, tampered with, or from an incompatible version."""


class InputError(FxQuantError, ValueError):
    """Example inputs or data batches do not fit the model (wrong shape, dtype, device, empty batch)."""


__all__ = [
    "ArtifactError",
    "BackendUnavailableError",
    "CalibrationError",
    "ConfigError",
    "FxQuantError",
    "InputError",
    "TraceError",
]

"""Moved to :mod:`fxquant.tuning.budget`; this path works for one more release (it was named in the docs)."""

import warnings

from fxquant.tuning.budget import quantize_within_budget

__all__ = ["quantize_within_budget"]

warnings.warn("fxquant.fallback moved to fxquant.tuning.budget; import it from there",
              DeprecationWarning, stacklevel=2)

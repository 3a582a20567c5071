"""Moved to :mod:`fxquant.tuning.sensitivity`; this path works for one more release (it was named in the docs)."""

import warnings

from fxquant.tuning.sensitivity import layer_sqnr, quantized_layer_paths

__all__ = ["layer_sqnr", "quantized_layer_paths"]

warnings.warn("fxquant.sensitivity moved to fxquant.tuning.sensitivity; import it from there",
              DeprecationWarning, stacklevel=2)

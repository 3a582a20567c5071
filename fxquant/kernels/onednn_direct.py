"""Moved to :mod:`fxquant.kernels.onednn.direct`; this path works for one more release (it was named in the docs)."""

import warnings

from fxquant.kernels.onednn.direct import available, status

__all__ = ["available", "status"]

warnings.warn("fxquant.kernels.onednn_direct moved to fxquant.kernels.onednn.direct; import it from there",
              DeprecationWarning, stacklevel=2)

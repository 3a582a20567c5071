"""Moved to :mod:`fxquant.runtime.runner`; this path works for one more release (it was named in the docs)."""

import warnings

from fxquant.runtime.runner import GraphRunner, install

__all__ = ["GraphRunner", "install"]

warnings.warn("fxquant.runner moved to fxquant.runtime.runner; import it from there",
              DeprecationWarning, stacklevel=2)

"""Moved to :mod:`fxquant.native.isa`; this path works for one more release (it was named in the docs)."""

import warnings

from fxquant.native.isa import cpu_model, has_vnni, isa_cap, isa_summary

__all__ = ["cpu_model", "has_vnni", "isa_cap", "isa_summary"]

warnings.warn("fxquant.cpu moved to fxquant.native.isa; import it from there",
              DeprecationWarning, stacklevel=2)

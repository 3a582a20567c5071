"""fxquant's optional C loops (``fxquant/native/csrc/``, built by setup.py) and one typed wrapper per loop.

- :mod:`~fxquant.native.loader`: the extension, ``FXQUANT_NATIVE=0``, the ISA cap and the thread rule
  (:data:`loops`, :func:`loops_for`, :func:`available`, :data:`THREAD_LIMITS`);
- :mod:`~fxquant.native.histogram`: :func:`scan_into`, the histogram observers' counting;
- :mod:`~fxquant.native.elementwise`: :func:`quantize_into`, :func:`channel_means_into`, :func:`mul_into`,
  :func:`lookup_into`, :func:`concat` (and :func:`dense_format`, the layout test their callers share;
  :func:`quantize_call`, :func:`channel_means_call` and :func:`max_pool_call`, loops on raw addresses, the last
  only so: a replay repeats them);
- :mod:`~fxquant.native.amx_gemm`: :func:`conv_into`, :func:`linear_rows_into`, :func:`patches_into`;
- :mod:`~fxquant.native.isa` (what the CPU and ``FXQUANT_ISA`` allow) and :mod:`~fxquant.native.scratch`.

:data:`loops` is None when fxquant was installed without a C compiler or the environment sets ``FXQUANT_NATIVE=0``,
and every caller keeps a torch path with the same results: the loops are speed, never semantics. A caller asks
first, then calls the wrapper::

    from fxquant import native
    if native.available("elementwise") and native.dense_format(a) is not None:
        out = native.lookup_into(torch.empty_like(a), a, table)
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

from fxquant.native import isa, loader, scratch
from fxquant.native.amx_gemm import Requant, conv_into, linear_rows_into, patches_into
from fxquant.native.elementwise import (
    ByteLevels,
    MulLayout,
    MulRequant,
    PoolShape,
    PoolWindow,
    QuantizeParams,
    channel_means_call,
    channel_means_into,
    concat,
    dense_format,
    lookup_into,
    max_pool_call,
    mul_into,
    quantize_call,
    quantize_into,
)
from fxquant.native.histogram import Scan, scan_into
from fxquant.native.loader import DISABLE_ENV, THREAD_LIMITS, available, loops_for

if TYPE_CHECKING:
    from fxquant.native.loader import loops

__all__ = [
    "DISABLE_ENV", "THREAD_LIMITS", "ByteLevels", "MulLayout", "MulRequant", "PoolShape", "PoolWindow",
    "QuantizeParams", "Requant", "Scan", "available", "channel_means_call", "channel_means_into", "concat", "conv_into",
    "dense_format", "isa", "linear_rows_into", "loader", "lookup_into", "loops", "loops_for", "max_pool_call",
    "mul_into", "patches_into", "quantize_call", "quantize_into", "scan_into", "scratch",
]


class _Package(ModuleType):
    """``fxquant.native`` itself, whose ``loops`` is the loader's switch: reading ``native.loops`` reads
    :data:`fxquant.native.loader.loops`, and setting it (tests turn the loops off with
    ``monkeypatch.setattr(native, "loops", None)``) sets the one that :func:`loops_for`, :func:`available` and the
    wrappers read. A plain re-export would be a copy that setting it leaves behind."""

    @property
    def loops(self) -> ModuleType | None:
        return loader.loops

    @loops.setter
    def loops(self, value: ModuleType | None) -> None:
        loader.loops = value


sys.modules[__name__].__class__ = _Package

"""The optional C loops (``fxquant/_native.c``), or None when fxquant was installed without a C compiler.

Every caller keeps a torch path with the same results: the loops are speed, never semantics.
"""

from __future__ import annotations

from types import ModuleType

loops: ModuleType | None
try:
    from fxquant import _native as loops
except ImportError:  # no compiler at install time: the torch paths
    loops = None

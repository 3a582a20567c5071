"""Build configuration beyond pyproject.toml: the optional C loops (histogram counting, quantize, pooling, mul).

``optional=True``: where no C compiler is available the install still succeeds and fxquant uses its torch paths
(same results, slower; :mod:`fxquant.native`). ``-ffp-contract=off``: no fused multiply-adds, so every float
operation rounds where the torch path rounds.
"""

import sys

from setuptools import Extension, setup

setup(ext_modules=[Extension("fxquant._native", ["fxquant/_native.c"], optional=True,
                             libraries=[] if sys.platform == "win32" else ["m"],
                             extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off"])])

"""Build configuration beyond pyproject.toml: the optional C extensions.

``fxquant._native``: C loops (histogram counting, quantize, pooling, mul). ``-ffp-contract=off``: no fused
multiply-adds, so every float operation rounds where the torch path rounds.
``fxquant._dnnl``: oneDNN primitives called directly (it dlopens the library at run time; nothing to link).
``optional=True``: where no C compiler is available the install still succeeds and fxquant uses its torch paths
(same results, slower; :mod:`fxquant.native`, :mod:`fxquant.kernels.onednn_direct`).
"""

import sys

from setuptools import Extension, setup

POSIX = sys.platform != "win32"
extensions = [Extension("fxquant._native", ["fxquant/_native.c"], optional=True, libraries=["m"] if POSIX else [],
                        extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off"])]
if POSIX:
    extensions.append(Extension("fxquant._dnnl", ["fxquant/_dnnl.c"], optional=True, libraries=["dl"],
                                extra_compile_args=["-O2", "-std=gnu99"]))
setup(ext_modules=extensions)

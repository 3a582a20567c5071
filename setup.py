"""Build configuration beyond pyproject.toml: the optional C extensions.

``fxquant.native._native``: C loops (histogram counting, element-wise int8 ops, VNNI/AMX GEMMs), one source file
per kernel family under ``fxquant/native/csrc/`` plus ``module.c``, the Python entry points. ``-ffp-contract=off``:
no fused multiply-adds, so every float operation rounds where the torch path rounds.
``fxquant.kernels.onednn._dnnl``: oneDNN primitives called directly (it dlopens the library at run time; nothing
to link).
``optional=True``: where no C compiler is available the install still succeeds and fxquant uses its torch paths
(same results, slower; :mod:`fxquant.native`, :mod:`fxquant.kernels.onednn.direct`).
"""

import sys

from setuptools import Extension, setup

POSIX = sys.platform != "win32"
NATIVE_SOURCES = [f"fxquant/native/csrc/{name}.c"
                  for name in ("module", "module_rows", "histogram", "elementwise", "amx_gemm", "rows_avx2", "patches",
                               "weight_only", "int8_rows", "int8_groups", "attention", "full_attention", "pool",
                               "winograd_avx2", "depthwise_avx2", "layer_norm")]
NATIVE_HEADERS = ["fxquant/native/csrc/native.h", "fxquant/native/csrc/gemm.h", "fxquant/native/csrc/module_rows.h",
                  "fxquant/native/csrc/exp2.h", "fxquant/native/csrc/onednn_requant.h",
                  "fxquant/native/csrc/avx2_convs.h"]
# OpenMP for the few-row Linear loops, which split their outputs over torch's intra-op threads: on Linux the
# extension links libgomp.so.1 by name, and torch has loaded its own copy of that library by then, so both share
# one runtime and one thread pool (fxquant.native imports torch first)
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
extensions = [Extension("fxquant.native._native", NATIVE_SOURCES, depends=NATIVE_HEADERS,
                        optional=True, libraries=["m"] if POSIX else [],
                        extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off", *OPENMP],
                        extra_link_args=OPENMP)]
if POSIX:
    dnnl_sources = [f"fxquant/kernels/onednn/csrc/{name}.c" for name in ("module", "loader", "primitive", "reorder")]
    extensions.append(Extension("fxquant.kernels.onednn._dnnl", dnnl_sources, optional=True, libraries=["dl"],
                                depends=["fxquant/kernels/onednn/csrc/dnnl_api.h"],
                                extra_compile_args=["-O2", "-std=gnu99"]))
setup(ext_modules=extensions)

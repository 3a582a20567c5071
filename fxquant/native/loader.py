"""The optional C extension ``fxquant.native._native`` (``fxquant/native/csrc/``), and where its loops may run.

:data:`loops` is the extension, or None when fxquant was installed without a C compiler or the environment sets
``FXQUANT_NATIVE=0``: the one switch every caller tests, through :func:`loops_for` or :func:`available`. Every caller
keeps a torch path with the same results: the loops are speed, never semantics.

:data:`extension` is the same module under the name mypy types by its stub (``_native.pyi``); only the typed
wrappers (:mod:`~fxquant.native.histogram`, :mod:`~fxquant.native.elementwise`, :mod:`~fxquant.native.amx_gemm`)
call it, once a caller has checked :data:`loops`.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

from fxquant.native.isa import isa_cap

try:
    import fxquant.native._native as extension
except ImportError:  # no compiler at install time: the torch paths
    extension = None  # type: ignore[assignment]

DISABLE_ENV = "FXQUANT_NATIVE"  # "0": the torch (and engine) paths everywhere, e.g. to compare or to debug

loops: ModuleType | None = None if os.environ.get(DISABLE_ENV) == "0" else extension


def set_isa_cap(level: int) -> None:
    """Caps the instruction sets the C loops use at ``ISA_LEVELS[level]`` (:mod:`fxquant.native.isa`). The C side
    holds one cap for the process, which is why :mod:`fxquant.native` sets it once, from ``FXQUANT_ISA``, at load."""
    extension.set_isa_cap(level)


if loops is not None:
    set_isa_cap(isa_cap(strict=False))


# The thread rule. The loops here run on one thread (except the dynamic and weight-only Linears' few-row loops, the
# AVX2 few-row Linear, the Winograd and depthwise convs and the per-token quantize and rescale, which split their
# outputs over torch's OpenMP threads),
# while the kernels they replace (fbgemm's, qnnpack's, torch's element-wise ops) split their work across torch's
# intra-op threads. So each family runs only up to the largest torch thread count at which it was measured faster
# than what it replaces, and yields to that kernel above it, at any thread count (docs/amx.md "Threads" gives the
# measurements; scripts/bench_amx_layers.py and scripts/bench_llm_layers.py --threads N).
# The per-group dynamic Linear's loop has no engine kernel to yield to (its torch path is a float GEMM per group of
# inputs, slower at any thread count): it runs at every count, its tiles split over all of torch's threads. So do
# the attention loops: their work items (a head and 8 query rows each for the causal loop, dealt round robin; a
# head and 32 rows for the full one, split evenly) go to all of torch's threads, as torch's flash attention splits
# the same heads and rows; and so do the residual add + LayerNorm loop's rows, as torch's LayerNorm splits them.
THREAD_LIMITS = {"conv": 2, "fbgemm_linear": 1, "qnnpack_linear": 2, "avx2_linear": 2, "onednn_linear": 2,
                 "onednn_winograd": 2, "onednn_depthwise": 2, "upsample": 1, "elementwise": 2, "histogram": 4,
                 "weight_only": 2, "int8_rows": 2, "int8_groups": sys.maxsize, "attention": sys.maxsize,
                 "layer_norm": sys.maxsize}


def loops_for(family: str = "elementwise") -> ModuleType | None:
    """The C loops where they are here and ``family``'s (:data:`THREAD_LIMITS`) may run at torch's current thread
    count, else None."""
    return loops if loops is not None and torch.get_num_threads() <= THREAD_LIMITS[family] else None


def available(family: str = "elementwise") -> bool:
    """Whether ``family``'s loops may run now (:func:`loops_for`)."""
    return loops_for(family) is not None

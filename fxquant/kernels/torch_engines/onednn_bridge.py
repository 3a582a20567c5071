"""fbgemm's float-output Linears on oneDNN: the same integers, run by the ``onednn`` backend.

fbgemm's own float-output Linear saturates 16-bit pair sums on 8-bit inputs (``FbgemmBackend`` says why it is
avoided), so ``FbgemmBackend.linear_to_float`` hands the layer's stored integers and its weight, repacked once for
oneDNN, to the ``onednn`` backend where this torch build has it.
"""

from __future__ import annotations

import functools

from fxquant.kernels.base import Backend, PackedWeight
from fxquant.kernels.registry import get_backend
from fxquant.kernels.torch_engines.engine import unpacked_linear


@functools.cache
def onednn_backend() -> Backend | None:
    """The oneDNN backend where this torch build has it (it runs fbgemm's float-output Linears), else None."""
    backend = get_backend("onednn")
    return backend if backend.is_available() else None


def onednn_weight(packed: PackedWeight, backend: Backend) -> PackedWeight:
    """``packed``'s weight repacked for oneDNN, once (kept on ``packed``; only float-output Linears need it)."""
    repacked = getattr(packed, "_onednn", None)
    if repacked is None:
        weight, w_qp, bias = unpacked_linear(packed.payload[0])
        repacked = backend.prepack_linear(weight, w_qp, bias)
        packed._onednn = repacked  # type: ignore[attr-defined]
    return repacked

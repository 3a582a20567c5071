"""Element-wise float functions between int8 values, as one 256-entry table lookup.

An activation with no int8 kernel (SiLU, hardswish, GELU, Mish, ELU, ...) between two int8 ops runs as dequantize,
the function in float, quantize: three passes over the tensor, two of them in float32. Its input has only 256
possible bytes, so its output is a function of the byte: ``QuantizedLookup`` computes that function once per
byte at convert time, with the backend's own dequantize, the float function and the backend's own quantize (the same
operations the unfused graph runs), and applies it in one byte-to-byte pass (``fxquant/native/csrc/elementwise.c``:
64 bytes per AVX512-VBMI step). One byte pass instead of three passes, two in float32, is why SiLU-heavy convnets
gain from it (measured in docs/quantization.md, "Activations as table lookups").

The results are the unfused graph's except where float32 evaluation of the function itself differs by an ulp
between torch's vectorized loop and its scalar tail, which moves a value across a rounding boundary: at most one
step, rarely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.kernels.base import Backend
from fxquant.nn.quantized import _BackendModule
from fxquant.qparams import QParams

# Functions of one value with no state beyond constant options: the module forms and the functional ones.
_MODULES: tuple[type[nn.Module], ...] = (
    nn.SiLU, nn.Hardswish, nn.GELU, nn.Mish, nn.ELU, nn.CELU, nn.SELU, nn.LeakyReLU, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Sigmoid, nn.Tanh, nn.Hardsigmoid)
_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset({
    F.silu, F.hardswish, F.gelu, F.mish, F.elu, F.celu, F.selu, F.leaky_relu, F.softplus, F.softsign, F.tanhshrink,
    torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.hardsigmoid})


def elementwise_function(node: fx.Node, modules: Mapping[str, nn.Module]) -> Callable[[torch.Tensor], Any] | None:
    """The float function ``node`` applies to its first argument, value by value, if it is one of the known
    activations with constant options; else None."""
    if node.op == "call_module":
        module = modules[str(node.target)]
        return module if type(module) in _MODULES and len(node.args) == 1 and not node.kwargs else None
    if node.op != "call_function" or node.target not in _FUNCTIONS or not node.args:
        return None
    options = (*node.args[1:], *node.kwargs.values())
    if any(isinstance(option, fx.Node) for option in options):
        return None
    assert callable(node.target)
    return functools.partial(node.target, *node.args[1:], **node.kwargs) if len(options) else node.target


class QuantizedLookup(_BackendModule):
    """``function`` of an int8 value at ``qa``, rounded to ``qout``, by a 256-entry table of this backend's
    results (recomputed when the module is re-lowered to another backend)."""

    def __init__(self, function: Callable[[torch.Tensor], Any], qa: QParams, qout: QParams,
                 backend: Backend) -> None:
        super().__init__(backend)
        self.function, self.qa, self.out_qp = function, qa, qout
        self.table = backend.lookup_table(function, qa, qout)  # derived from the qparams: not in the state dict

    def relower(self, backend: Backend) -> None:
        super().relower(backend)
        self.table = backend.lookup_table(self.function, self.qa, self.out_qp)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.backend.lookup(a, self.table, self.out_qp)

    def extra_repr(self) -> str:
        name = getattr(self.function, "__name__", None) or getattr(getattr(self.function, "func", None), "__name__",
                                                                     type(self.function).__name__)
        scale, zp = self.out_qp.scalar()
        return f"{name}, scale={scale:.4g}, zero_point={zp}, backend={self.backend.name}"

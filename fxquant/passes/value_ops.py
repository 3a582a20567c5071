"""Read the options of a ReLU / pooling node, in module, function or method form, into one shape; and the
fixed output range of sigmoid-like functions, whose int8 output qparams depend on the function, not on data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.qparams import QParams

_PARAMS = {
    "avg": ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
    "max": ("kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    "adaptive_avg": ("output_size",),
}
_FUNCTIONS: dict[Any, tuple[str, int]] = {
    F.adaptive_avg_pool1d: ("adaptive_avg", 1), F.adaptive_avg_pool2d: ("adaptive_avg", 2),
    F.adaptive_avg_pool3d: ("adaptive_avg", 3), F.avg_pool1d: ("avg", 1), F.avg_pool2d: ("avg", 2),
    F.avg_pool3d: ("avg", 3), F.max_pool1d: ("max", 1), F.max_pool2d: ("max", 2), F.max_pool3d: ("max", 3),
}
_MODULES: dict[type[nn.Module], tuple[str, int]] = {
    nn.AdaptiveAvgPool1d: ("adaptive_avg", 1), nn.AdaptiveAvgPool2d: ("adaptive_avg", 2),
    nn.AdaptiveAvgPool3d: ("adaptive_avg", 3), nn.AvgPool1d: ("avg", 1), nn.AvgPool2d: ("avg", 2),
    nn.AvgPool3d: ("avg", 3), nn.MaxPool1d: ("max", 1), nn.MaxPool2d: ("max", 2), nn.MaxPool3d: ("max", 3),
}
# Bounded functions run int8 with output qparams fixed by their range (what torch's quantized kernels produce:
# sigmoid/hardsigmoid at scale 1/256 and zero point 0, tanh at 2/256 and 128), so they need no observer.
FIXED_RANGES: dict[str, tuple[float, float]] = {"sigmoid": (0.0, 1.0), "hardsigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0)}
_FIXED_FUNCTIONS: dict[Any, str] = {torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", torch.tanh: "tanh",
                                    F.tanh: "tanh", F.hardsigmoid: "hardsigmoid"}
_FIXED_MODULES: dict[type[nn.Module], str] = {nn.Sigmoid: "sigmoid", nn.Tanh: "tanh", nn.Hardsigmoid: "hardsigmoid"}
FIXED_FUNCTIONS = frozenset(_FIXED_FUNCTIONS)
FIXED_MODULES: tuple[type[nn.Module], ...] = tuple(_FIXED_MODULES)
FIXED_METHODS = frozenset({"sigmoid", "tanh"})
POOL_FUNCTIONS = frozenset(_FUNCTIONS)
POOL_MODULES: tuple[type[nn.Module], ...] = tuple(_MODULES)


def pool_options(node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[str, int, dict[str, Any]] | None:
    """``None`` for a ReLU; ``(kind, dim, options)`` for a pool (kind: avg, max, adaptive_avg)."""
    if node.op == "call_module":
        module = modules[str(node.target)]
        if type(module) not in _MODULES:
            return None
        kind, dim = _MODULES[type(module)]
        return kind, dim, {n: getattr(module, n) for n in _PARAMS[kind] if hasattr(module, n)}
    if node.op == "call_function" and node.target in _FUNCTIONS:
        kind, dim = _FUNCTIONS[node.target]
        options = dict(zip(_PARAMS[kind], node.args[1:], strict=False))
        options.update(node.kwargs)
        options.pop("return_indices", None)
        return kind, dim, options
    return None


def fixed_function(node: fx.Node, modules: Mapping[str, nn.Module]) -> str | None:
    """``"sigmoid"``, ``"hardsigmoid"`` or ``"tanh"`` for a node computing one of them (any form), else None."""
    if node.op == "call_module":
        return _FIXED_MODULES.get(type(modules[str(node.target)]))
    if node.op == "call_function":
        return _FIXED_FUNCTIONS.get(node.target)
    if node.op == "call_method" and node.target in FIXED_METHODS:
        return str(node.target)
    return None


def fixed_qparams(function: str, qrange: tuple[int, int]) -> QParams:
    """The output qparams of int8 ``function``: its range ``[lo, hi]`` split into ``qmax - qmin + 1`` steps (so
    ``hi`` itself saturates one step below, as in torch's kernels), ``lo`` at ``qmin``."""
    lo, hi = FIXED_RANGES[function]
    qmin, qmax = qrange
    scale = (hi - lo) / (qmax - qmin + 1)
    zero_point = qmin - round(lo / scale)
    return QParams(torch.tensor(scale), torch.tensor(zero_point), qmin, qmax)

"""Read the options of a ReLU / average-pool node, in module, function or method form, into one shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import fx, nn

_AVG_PARAMS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
_FUNCTIONS: dict[Any, tuple[int, bool]] = {
    F.adaptive_avg_pool1d: (1, True), F.adaptive_avg_pool2d: (2, True), F.adaptive_avg_pool3d: (3, True),
    F.avg_pool1d: (1, False), F.avg_pool2d: (2, False), F.avg_pool3d: (3, False),
}
_MODULES: dict[type[nn.Module], tuple[int, bool]] = {
    nn.AdaptiveAvgPool1d: (1, True), nn.AdaptiveAvgPool2d: (2, True), nn.AdaptiveAvgPool3d: (3, True),
    nn.AvgPool1d: (1, False), nn.AvgPool2d: (2, False), nn.AvgPool3d: (3, False),
}


def value_module_options(node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[int, bool, dict] | None:
    """``None`` for a ReLU; ``(dim, adaptive, options)`` for an average pool."""
    if node.op == "call_module":
        module = modules[str(node.target)]
        if type(module) not in _MODULES:
            return None
        dim, adaptive = _MODULES[type(module)]
        names = ("output_size",) if adaptive else _AVG_PARAMS
        return dim, adaptive, {n: getattr(module, n) for n in names if hasattr(module, n)}
    if node.op == "call_function" and node.target in _FUNCTIONS:
        dim, adaptive = _FUNCTIONS[node.target]
        names = ("output_size",) if adaptive else _AVG_PARAMS
        options = dict(zip(names, node.args[1:], strict=False))
        options.update(node.kwargs)
        return dim, adaptive, options
    return None

"""Fuse a Linear/Conv with the ReLU/ReLU6/hardtanh after it, and a residual add with the ReLU after it."""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn.functional as F
from torch import fx, nn

from fxquant.nn.fused import Fused, add_relu, compute_module
from fxquant.passes._graph import finish, modules_of, nodes_of, only_user, replace_submodule
from fxquant.passes.patterns import OpKind, classify, is_mul, is_relu


def _clamp_of(node: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[float, float | None, str] | None:
    """(min, max, name) when ``node`` is ReLU, ReLU6 or a hardtanh whose range contains 0."""
    if is_relu(node, modules):
        return 0.0, None, "relu"
    if node.op == "call_module":
        m = modules[str(node.target)]
        if isinstance(m, nn.Hardtanh):  # ReLU6 is a Hardtanh(0, 6)
            return _hardtanh_range(m.min_val, m.max_val)
    if node.op == "call_function" and node.target is F.relu6:
        return 0.0, 6.0, "relu6"
    if node.op == "call_function" and node.target is F.hardtanh:
        lo = node.kwargs.get("min_val", node.args[1] if len(node.args) > 1 else -1.0)
        hi = node.kwargs.get("max_val", node.args[2] if len(node.args) > 2 else 1.0)
        return _hardtanh_range(lo, hi)
    return None


def _hardtanh_range(lo: object, hi: object) -> tuple[float, float | None, str] | None:
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)) or not lo <= 0 <= hi:
        return None  # a clamp that excludes 0 cannot be applied by saturating at the observed range
    return float(lo), float(hi), "relu6" if (lo, hi) == (0, 6) else f"hardtanh({lo}, {hi})"


def fuse_activations(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``act(layer(x))`` into ``Fused(layer, act)(x)`` and ``relu(a + b)`` into ``add_relu(a, b)``."""
    modules = modules_of(gm)
    for node in nodes_of(gm):
        kind = classify(node, modules)
        user = only_user(node)
        if user is None or kind not in (OpKind.COMPUTE, OpKind.BINARY) or user.args[0] is not node:
            continue
        path = str(node.target)
        if kind is OpKind.COMPUTE and compute_module(modules[path]) is modules[path]:
            clamp = _clamp_of(user, modules)
            if clamp is not None:
                modules[path] = Fused(modules[path], *clamp)
                replace_submodule(gm, path, modules[path])
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
        elif kind is OpKind.BINARY and not is_mul(node) and is_relu(user, modules):  # relu(a * b) is no add_relu
            with gm.graph.inserting_after(user):
                fused = gm.graph.call_function(add_relu, tuple(node.args[:2]))
            user.replace_all_uses_with(fused)
            gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    return finish(gm)

"""Fold eval-mode BatchNorm into the Conv/Linear before it: same function, one layer less to quantize."""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from fxquant.passes._graph import finish, modules_of, only_user, replace_submodule

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FOLDABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@torch.no_grad()
def fold_into(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A copy of ``layer`` computing ``bn(layer(x))``: w' = w * g / sqrt(var + eps), b' = (b - mean) * ... + beta."""
    fused = copy.deepcopy(layer)
    assert bn.running_var is not None and bn.running_mean is not None  # eval-mode BN always tracks stats
    inv_std = torch.rsqrt(bn.running_var + bn.eps)
    gamma = bn.weight if bn.weight is not None else torch.ones_like(inv_std)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(inv_std)
    factor = gamma * inv_std
    shape = [-1] + [1] * (fused.weight.dim() - 1)
    fused.weight.copy_(fused.weight * factor.reshape(shape))
    bias = fused.bias if fused.bias is not None else torch.zeros_like(bn.running_mean)
    fused.bias = nn.Parameter((bias - bn.running_mean) * factor + beta)
    return fused


def fold_batchnorm(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold every ``BatchNormNd`` whose input is a Conv/Linear used only by it."""
    modules = modules_of(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(modules[node.target], _BN_TYPES):
            continue
        producer = node.args[0]
        if not (isinstance(producer, fx.Node) and producer.op == "call_module" and only_user(producer) is node):
            continue
        layer = modules[producer.target]
        bn = modules[node.target]
        if type(layer) not in _FOLDABLE or not bn.track_running_stats or bn.num_features != layer.weight.shape[0]:
            continue
        replace_submodule(gm, producer.target, fold_into(layer, bn))
        node.replace_all_uses_with(producer)
        gm.graph.erase_node(node)
    return finish(gm)

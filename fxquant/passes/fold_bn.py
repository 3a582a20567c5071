"""Fold eval-mode BatchNorm into the Conv/Linear before it: same function, one layer less to quantize."""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from fxquant.passes._graph import finish, modules_of, nodes_of, only_user, replace_submodule

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_FOLDABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d)


def _out_axis(layer: nn.Module) -> int:
    """Output channels are axis 0 of a weight, except for transposed convs (in, out/groups, k...)."""
    return 1 if isinstance(layer, nn.modules.conv._ConvTransposeNd) else 0


def _out_channels(layer: nn.Module) -> int:
    if isinstance(layer, nn.modules.conv._ConvTransposeNd) and layer.groups != 1:
        return -1  # grouped transposed weights interleave groups on axis 1: not folded
    return int(_weight(layer).shape[_out_axis(layer)])


def _channels_on_dim_1(layer: nn.Module, node: fx.Node) -> bool:
    """A Linear's features are its output's last dim, BatchNorm's channels dim 1: they agree only on 2-D outputs,
    which the recorded shapes (``tensor_meta`` from the example run) must confirm."""
    if not isinstance(layer, nn.Linear):
        return True
    meta = node.meta.get("tensor_meta")
    return meta is not None and len(getattr(meta, "shape", ())) == 2


def _weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return weight


@torch.no_grad()
def fold_into(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A copy of ``layer`` computing ``bn(layer(x))``: w' = w * g / sqrt(var + eps), b' = (b - mean) * ... + beta."""
    fused = copy.deepcopy(layer)
    mean, var = bn.running_mean, bn.running_var
    assert isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor)  # callers check track_running_stats
    inv_std = torch.rsqrt(var + bn.eps)
    gamma = bn.weight if bn.weight is not None else torch.ones_like(inv_std)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(inv_std)
    factor = gamma * inv_std
    weight = _weight(fused)
    shape = [1] * weight.dim()
    shape[_out_axis(layer)] = -1
    weight.copy_(weight * factor.reshape(shape))
    bias = fused.bias if isinstance(fused.bias, torch.Tensor) else torch.zeros_like(mean)
    fused.bias = nn.Parameter((bias - mean) * factor + beta)
    return fused


def fold_batchnorm(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold every ``BatchNormNd`` whose input is a Conv/Linear used only by it."""
    modules = modules_of(gm)
    for node in nodes_of(gm):
        bn = modules.get(str(node.target)) if node.op == "call_module" else None
        producer = node.args[0] if node.args else None
        if not isinstance(bn, _BN_TYPES) or not isinstance(producer, fx.Node) or producer.op != "call_module":
            continue
        layer = modules[str(producer.target)]
        if only_user(producer) is not node or type(layer) not in _FOLDABLE or not bn.track_running_stats:
            continue
        if bn.num_features != _out_channels(layer) or not _channels_on_dim_1(layer, producer):
            continue
        modules[str(producer.target)] = fold_into(layer, bn)  # a second BN in a row folds into this one
        replace_submodule(gm, str(producer.target), modules[str(producer.target)])
        node.replace_all_uses_with(producer)
        gm.graph.erase_node(node)
    return finish(gm)

"""Where SmoothQuant's ``1/s`` goes once the scales are known: folded into the producer of the smoothed value (a
LayerNorm/RMSNorm or a Linear (+ ReLU) that only the smoothed group reads; free at inference), or else an explicit
:class:`ChannelScale` in front of a new observer. Only the graph surgery; the statistics, the scales and the alpha
stay in :mod:`fxquant.passes.smoothquant`, whose docstring gives the costs of each way.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from fxquant.nn.fused import Fused, compute_module
from fxquant.observers import MinMaxObserver, Observer
from fxquant.passes._graph import replace_submodule
from fxquant.passes._stats import absorbed_by_producer, is_activation_observer, unique_name

__all__ = ["ChannelScale", "divide_activation"]

_NORMS: tuple[type[nn.Module], ...] = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)


class ChannelScale(nn.Module):
    """``x * scale`` along the last axis: SmoothQuant's explicit smoothing where ``1/s`` cannot be folded."""

    scale: torch.Tensor

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"channels={self.scale.numel()}"


def _fold_into(module: nn.Module, inverse: torch.Tensor) -> bool:
    """Divide ``module``'s output channels by s (``inverse`` = 1/s) if it is a norm or a Linear (+ ReLU)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    shape = tuple(getattr(module, "normalized_shape", ()))
    if isinstance(module, _NORMS) and isinstance(weight, torch.Tensor) and shape == (inverse.numel(),):
        weight.mul_(inverse)
        if isinstance(bias, torch.Tensor):
            bias.mul_(inverse)
        return True
    layer = compute_module(module)
    relu_only = not isinstance(module, Fused) or (module.min_val == 0.0 and module.max_val is None)
    if isinstance(layer, nn.Linear) and relu_only and layer.out_features == inverse.numel():
        layer.weight.mul_(inverse[:, None])
        if layer.bias is not None:
            layer.bias.mul_(inverse)
        return True
    return False


def _fold(gm: fx.GraphModule, statistics_node: fx.Node, scales: torch.Tensor, observer: MinMaxObserver | None) -> bool:
    """Fold 1/s into the producer of the observed value (of the value itself where ``observer`` is None: float-in
    readers) when the smoothed layers are its only readers."""
    key = statistics_node.args[0]
    if not isinstance(key, fx.Node):
        return False
    if observer is None:
        producer = key
    elif is_activation_observer(gm, key) and set(key.users) == {statistics_node}:
        producer = key.args[0]  # type: ignore[assignment]
    else:
        return False
    readers = {statistics_node} if observer is None else {key}
    if not isinstance(producer, fx.Node) or set(producer.users) != readers or producer.op != "call_module":
        return False
    if not _fold_into(gm.get_submodule(str(producer.target)), 1.0 / scales):
        return False
    if observer is not None:
        observer.label = getattr(gm.get_submodule(str(key.target)), "label", observer.label)
        replace_submodule(gm, str(key.target), observer)
    return True


def _insert_scale(gm: fx.GraphModule, statistics_node: fx.Node, scales: torch.Tensor,
                  observer: Observer | None) -> None:
    """``value -> ChannelScale(1/s) -> observer -> layers`` (reading the float value behind an input observer);
    without ``observer`` (float-in readers), ``value -> ChannelScale(1/s) -> layers``."""
    source = statistics_node.args[0]
    assert isinstance(source, fx.Node)
    if is_activation_observer(gm, source) and not absorbed_by_producer(gm, source):
        source = source.args[0]  # skip a quantize that the multiply would undo
        assert isinstance(source, fx.Node)
    scale_name = unique_name(gm, "smoothquant_scale_")
    gm.add_submodule(scale_name, ChannelScale(1.0 / scales))
    with gm.graph.inserting_before(statistics_node):
        result = gm.graph.call_module(scale_name, (source,))
        if observer is not None:
            observer_name = unique_name(gm, "smoothquant_observer_")
            gm.add_submodule(observer_name, observer)
            result = gm.graph.call_module(observer_name, (result,))
    statistics_node.replace_all_uses_with(result)


def divide_activation(gm: fx.GraphModule, statistics_node: fx.Node, scales: torch.Tensor,
                      observer: MinMaxObserver | None) -> None:
    """Divide the value read through ``statistics_node`` by ``scales`` for its readers, quantized by ``observer``
    (None: the readers take float, as the ``static_outliers`` Linears do): folded into the producer where it can
    be, else an explicit :class:`ChannelScale` (in place)."""
    if not _fold(gm, statistics_node, scales, observer):
        _insert_scale(gm, statistics_node, scales, observer)

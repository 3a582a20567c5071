"""Bias correction: remove the mean output shift that rounding the weights to int8 gives each output channel.

Rounding is not zero-mean per channel once it is multiplied by real inputs: a per-tensor scale rounds whole
depthwise channels towards zero, and ReLU inputs are never centred. With ``E = W - W_q`` (float weight minus the
int8 weight convert will use) the quantized layer's output is shifted by ``E[E x]`` per output channel, so adding it
to the bias removes it (Nagel et al., "Data-Free Quantization", 2019, section 4.2, "empirical" variant).

``E[E x]`` needs, per layer, the mean of every input window the layer reads: for a Linear the mean of each input
feature, for a convolution the mean over samples and output positions of each (input channel, kernel offset) value
of the padded input (so padding zeros count where the convolution sees them). ``prepare`` inserts one
:class:`InputMeanObserver` per quantized layer when ``QuantConfig(bias_correction=True)``; calibration fills it;
``convert`` computes ``E[E x] = conv(mean_window, E)`` (``E @ mean`` for a Linear) and adds it to the float bias
before lowering, so the INT8 module is packed once with the corrected bias. Keeping statistics rather than batches
means the correction needs no extra data at convert time, merges across shards, and is rebuilt exactly when an
artifact is loaded. The shift of upstream layers' errors and of activation clipping is not modelled.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.config import QuantConfig
from fxquant.errors import CalibrationError
from fxquant.nn.fused import compute_module
from fxquant.observers import Observer
from fxquant.passes._graph import finish, nodes_of, only_user
from fxquant.passes._stats import (
    StatisticsObserver,
    drop_statistics_node,
    is_activation_observer,
    is_quantized_layer,
    module_of,
    unique_name,
)
from fxquant.passes.lower import weight_qparams
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import tensor_input
from fxquant.qparams import fake_quantize

STATISTICS_PREFIX = "bias_correction_statistics_"
Layer = nn.Linear | nn.modules.conv._ConvNd
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class Window:
    """How a convolution reads its input: kernel, stride, dilation, and the padding ``F.pad`` applies."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[int, ...]  # F.pad order (last dim first), as nn.ConvNd keeps it
    mode: str

    @classmethod
    def of(cls, conv: nn.modules.conv._ConvNd) -> Window:
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        return cls(tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.dilation),
                   tuple(conv._reversed_padding_repeated_twice), mode)


def window_sums(x: torch.Tensor, window: Window) -> tuple[torch.Tensor, int]:
    """Sum over samples and output positions of each (channel, kernel offset) input value, and how many positions.

    ``sums / count`` is the mean input window: ``conv(mean_window, W)`` is then the mean of ``conv(x, W)`` minus
    its bias, for any weight ``W`` with this geometry.
    """
    x = F.pad(x.double(), list(window.padding), mode=window.mode)
    spatial = x.shape[2:]
    sizes = [(n - d * (k - 1) - 1) // s + 1
             for n, k, s, d in zip(spatial, window.kernel, window.stride, window.dilation, strict=True)]
    reduce = [0, *range(2, x.dim())]
    sums = []
    for offset in itertools.product(*(range(k) for k in window.kernel)):
        index = tuple(slice(o * d, o * d + (n - 1) * s + 1, s)
                      for o, d, n, s in zip(offset, window.dilation, sizes, window.stride, strict=True))
        sums.append(x[(slice(None), slice(None), *index)].sum(dim=reduce))
    return torch.stack(sums, dim=1).reshape(x.shape[1], *window.kernel), x.shape[0] * math.prod(sizes)


class InputMeanObserver(StatisticsObserver):
    """The mean input window of one Linear/Conv over the calibration data (see :func:`window_sums`)."""

    total: torch.Tensor
    count: torch.Tensor

    def __init__(self, layer: Layer) -> None:
        super().__init__()
        if isinstance(layer, nn.Linear):
            self.window: Window | None = None
            shape: tuple[int, ...] = (layer.in_features,)
        else:
            self.window = Window.of(layer)
            shape = (layer.in_channels, *layer.kernel_size)
        self.register_buffer("total", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(0, dtype=torch.int64))

    def _update(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        channels = self.total.shape[0]
        if self.window is None:
            if x.dim() == 0 or x.shape[-1] != channels:
                raise CalibrationError(f"{self.label}: expected {channels} features, got shape {tuple(x.shape)}")
            flat = x.reshape(-1, channels)
            sums, count = flat.sum(dim=0, dtype=torch.float64), flat.shape[0]
        else:
            if x.dim() != len(self.window.kernel) + 2 or x.shape[1] != channels:
                raise CalibrationError(f"{self.label}: expected a batch with {channels} channels, got shape "
                                       f"{tuple(x.shape)}")
            sums, count = window_sums(x, self.window)
        self.total.add_(sums)
        self.count.add_(count)

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, InputMeanObserver)
        self.total.add_(other.total)
        self.count.add_(other.count)

    def mean(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).float()

    def rescale_channels(self, factor: torch.Tensor) -> None:
        """Statistics of ``x * factor`` (per input channel) from those of ``x``: what SmoothQuant's 1/s needs."""
        self.total.mul_(factor.double().reshape(-1, *[1] * (self.total.dim() - 1)))


def _correctable(gm: fx.GraphModule, node: fx.Node) -> Layer | None:
    """The Linear/Conv of a quantized layer node that lowering will turn into an INT8 module (not transposed)."""
    layer = compute_module(module_of(gm, node) or nn.Module())
    if layer is None or isinstance(layer, nn.modules.conv._ConvTransposeNd) or not is_quantized_layer(node):
        return None
    return layer if tensor_input(node) is not None and is_activation_observer(gm, only_user(node)) else None


def insert_bias_observers(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """Put an :class:`InputMeanObserver` right before each quantized Linear/Conv (in place) when asked for."""
    if not config.bias_correction:
        return gm
    for node in nodes_of(gm):
        layer = _correctable(gm, node)
        value = tensor_input(node)
        if layer is None or value is None:
            continue
        observer = InputMeanObserver(layer)
        observer.label = f"bias-correction statistics of the input of {prefix}{node.target}"
        name = unique_name(gm, STATISTICS_PREFIX)
        gm.add_submodule(name, observer)
        with gm.graph.inserting_before(node):
            statistics = gm.graph.call_module(name, (value,))
        node.replace_input_with(value, statistics)
    return finish(gm)


def bias_shift(layer: Layer, weight_error: torch.Tensor, mean_window: torch.Tensor) -> torch.Tensor:
    """``E[(W - W_q) x]`` per output channel, from the mean input window."""
    if isinstance(layer, nn.Linear):
        return weight_error @ mean_window
    conv = _CONV[mean_window.dim() - 1]
    return conv(mean_window[None], weight_error, groups=layer.groups).flatten()


@torch.no_grad()
def _correct(gm: fx.GraphModule, node: fx.Node, statistics: InputMeanObserver) -> None:
    layer = _correctable(gm, node)
    if layer is None:
        return
    weight = layer.weight.detach()
    error = weight - fake_quantize(weight, weight_qparams(node.meta[LAYER_SETTINGS], layer))
    shift = bias_shift(layer, error, statistics.mean())
    bias = layer.bias.detach() if layer.bias is not None else torch.zeros_like(shift)
    layer.bias = nn.Parameter(bias + shift)


def correct_biases(gm: fx.GraphModule) -> fx.GraphModule:
    """Add each quantized layer's mean output shift to its bias and remove the statistics nodes (in place).

    Called by ``convert`` on its copy of the prepared model, after SmoothQuant and before lowering. Example::

        qmodel = fxquant.quantize(model, example, data, QuantConfig(weight="per_tensor", bias_correction=True))
    """
    for node in nodes_of(gm):
        statistics = module_of(gm, node)
        if not isinstance(statistics, InputMeanObserver):
            continue
        layer_node = only_user(node)
        if statistics.has_data and layer_node is not None:
            _correct(gm, layer_node, statistics)
        drop_statistics_node(gm, node)
    return finish(gm)

"""Bias correction: remove the mean output shift that rounding the weights to int8 gives each output channel.

Rounding is not zero-mean per channel once it is multiplied by real inputs: a per-tensor scale rounds whole
depthwise channels towards zero, and ReLU inputs are never centred. With ``E = W - W_q`` (float weight minus the
int8 weight convert will use) the quantized layer's output is shifted by ``E[E x]`` per output channel, so adding it
to the bias removes it (Nagel et al., "Data-Free Quantization", 2019, section 4.2, "empirical" variant).

``E[E x]`` needs, per layer, the mean of every input window the layer reads: for a Linear the mean of each input
feature, for a convolution the mean over samples and output positions of each (input channel, kernel offset) value
of the padded input (so padding zeros count where the convolution sees them). ``prepare`` inserts one
:class:`InputMeanObserver` per quantized Linear (``QuantConfig(bias_correction="linear")``, the default) or per
quantized Linear and convolution (``bias_correction=True``; the accuracy each measured and the calibration cost of
each are in docs/accuracy.md: convolutions' statistics made a depthwise net's calibration forward up to 14%
slower); calibration fills it;
``convert`` computes ``E[E x] = conv(mean_window, E)`` (``E @ mean`` for a Linear) and adds it to the float bias
before lowering, so the INT8 module is packed once with the corrected bias. Keeping statistics rather than batches
means the correction needs no extra data at convert time, merges across shards, and is rebuilt exactly when an
artifact is loaded. The shift of upstream layers' errors and of activation clipping is not modelled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.config import QuantConfig
from fxquant.nn.fused import compute_module
from fxquant.observers import Observer
from fxquant.observers.counting import dense_flat
from fxquant.observers.histogram import sample_stride
from fxquant.passes._graph import finish, nodes_of, only_user
from fxquant.passes._stats import (
    StatisticsObserver,
    drop_statistics_node,
    insert_statistics,
    is_activation_observer,
    is_quantized_layer,
    module_of,
)
from fxquant.passes.lower import weight_qparams
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import tensor_input
from fxquant.qparams import fake_quantize

STATISTICS_PREFIX = "bias_correction_statistics_"
SAMPLE_VALUES = 1 << 18  # values of one batch a mean reads at most (whole samples / rows; see InputMeanObserver)
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


def _memory_order(x: torch.Tensor) -> list[int]:
    """Dim 0 first, then x's other dims from the largest stride to the smallest (its layout: NCHW, NHWC, ...)."""
    return [0, *sorted(range(1, x.dim()), key=lambda d: -x.stride()[d])]


def batch_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of ``x`` (dim 0 kept, float32 or float64 as ``x``; other dtypes in float32), as one product
    with a row of ones over ``x``'s memory order; the result keeps that order (its strides).

    torch's reduction over the outer dim took ~7 ns per value on a channels-last batch (longer than the convolution
    that reads it) and ~20 ns in float64; the product reads the batch once, ~0.2 ns per value.
    """
    if x.shape[0] == 1:
        return x if x.dtype in (torch.float32, torch.float64) else x.float()
    order = _memory_order(x)
    view = x.permute(order)
    view = view if view.dtype in (torch.float32, torch.float64) else view.float()
    total = view.new_ones(1, x.shape[0]) @ view.contiguous().reshape(x.shape[0], -1)
    return total.reshape(1, *view.shape[1:]).permute([order.index(d) for d in range(x.dim())])


@functools.lru_cache(maxsize=256)  # one per conv geometry and input size: built once, read by every batch
def _offsets(kernel: int, stride: int, dilation: int, before: int, length: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(kernel, length): row ``o`` counts how often each input position is kernel offset ``o`` of an output position
    (positions in the zero padding, ``before`` on each side, are left out), and the number of output positions."""
    outputs = (length + 2 * before - dilation * (kernel - 1) - 1) // stride + 1
    index = torch.arange(kernel)[:, None] * dilation + torch.arange(max(outputs, 0))[None, :] * stride - before
    inside = (index >= 0) & (index < length)
    counts = torch.zeros(kernel, length, dtype=dtype)
    return counts.scatter_add_(1, index.clamp(0, length - 1), inside.to(dtype)), outputs


def window_sums(x: torch.Tensor, window: Window) -> tuple[torch.Tensor, int]:
    """Sum over samples and output positions of each (channel, kernel offset) input value (float64), and how many
    positions.

    ``sums / count`` is the mean input window: ``conv(mean_window, W)`` is then the mean of ``conv(x, W)`` minus
    its bias, for any weight ``W`` with this geometry. Padding and the sums are linear in the input, so the samples
    are summed first (:func:`batch_sum`), then each spatial dim is contracted with its (kernel, length) matrix of
    :func:`_offsets`, first one at an end of the memory order (a product over the summed map in place, no copy), then
    the rest of a map smaller by that dim's length: where a pass per kernel offset over the batch cost 7x the
    convolution, this costs one read of the batch. Symmetric zero padding is in the matrices; other padding
    is applied to the summed map first.
    """
    sums = batch_sum(x)[0]  # (channels, *spatial), x's memory order
    spatial = len(window.kernel)
    before = [window.padding[2 * (spatial - 1 - i)] for i in range(spatial)]
    if window.mode != "constant" or before != [window.padding[2 * (spatial - 1 - i) + 1] for i in range(spatial)]:
        sums = F.pad(sums[None], list(window.padding), mode=window.mode)[0]
        before = [0] * spatial
    memory = sorted(range(sums.dim()), key=lambda d: -sums.stride()[d])
    sums, labels = sums.permute(memory), memory  # dense in memory order; labels: 0 channels, i spatial, -i offsets
    positions = 1
    for _ in range(spatial):
        # the first product reads the summed map in place: over its outermost dim where that is spatial (k, L) @
        # (L, rest), else over its innermost (rest, L) @ (L, k); later ones read maps smaller by those lengths
        where = 0 if labels[0] > 0 else max(i for i, label in enumerate(labels) if label > 0)
        dim = labels[where]
        counts, outputs = _offsets(window.kernel[dim - 1], window.stride[dim - 1], window.dilation[dim - 1],
                                   before[dim - 1], sums.shape[where], sums.dtype)  # cached: never written
        if where == 0:
            sums = (counts @ sums.reshape(sums.shape[0], -1)).reshape(-1, *sums.shape[1:])
            labels = [-dim, *labels[1:]]
        else:
            moved = sums.movedim(where, -1)
            sums = (moved.reshape(-1, moved.shape[-1]) @ counts.T).reshape(*moved.shape[:-1], -1)
            labels = [*labels[:where], *labels[where + 1:], -dim]
        positions *= outputs
    order = [labels.index(0), *(labels.index(-dim) for dim in range(1, spatial + 1))]
    return sums.permute(order).double(), x.shape[0] * positions


def sampled(x: torch.Tensor) -> torch.Tensor:
    """Every ``k``-th sample (row) of ``x`` along dim 0, ``k`` the smallest prime leaving at most SAMPLE_VALUES values
    plus one sample; all of ``x`` where it is that small. A mean needs far fewer values than a range (the accuracy in
    docs/accuracy.md is measured with this sample), and reading them costs a copy of the sample at most; prime so
    that a token batch's rows do not keep the same positions of every sequence."""
    rows = x.shape[0]
    if x.numel() <= SAMPLE_VALUES or rows < 2:
        return x
    stride = sample_stride(rows, SAMPLE_VALUES, run_values=x.numel() // rows)
    if stride >= rows:
        return x[:1]  # one row: a view, dense where x is
    order = _memory_order(x)  # copied dense in x's own layout: the range and the sums then read it without copies
    return x[::stride].permute(order).contiguous().permute([order.index(d) for d in range(x.dim())])


class InputMeanObserver(StatisticsObserver):
    """The mean input window of one Linear/Conv over the calibration data (see :func:`window_sums`), from a sample
    of each batch's rows (Linear) or samples (Conv) of at most SAMPLE_VALUES values (see :func:`sampled`)."""

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

    def _record(self, x: torch.Tensor) -> None:
        """The sums of a sample of ``x``, and the sample's range (for NaN/Inf and display; the activation observer
        of the same value reads all of it). A shape the layer cannot take records nothing: the layer, which runs
        next, raises torch's own error about it, which calibration reports as a batch that does not fit."""
        channels = self.total.shape[0]
        if self.window is None:
            if x.dim() == 0 or x.shape[-1] != channels:
                return
            sample = sampled(x.reshape(-1, channels))
        else:
            if x.dim() != len(self.window.kernel) + 2 or x.shape[1] != channels:
                return
            sample = sampled(x)
        lo, hi = torch.aminmax(dense_flat(sample))
        self._check_finite(lo.item(), hi.item())
        if self.window is None:
            sums, count = batch_sum(sample)[0], sample.shape[0]
        else:
            sums, count = window_sums(sample, self.window)
        self.total.add_(sums)
        self.count.add_(count)
        self._count(lo, hi, x.numel())

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
        if layer is None or value is None or (config.bias_correction == "linear" and not isinstance(layer, nn.Linear)):
            continue
        observer = InputMeanObserver(layer)
        observer.label = f"bias-correction statistics of the input of {prefix}{node.target}"
        insert_statistics(gm, node, value, observer, STATISTICS_PREFIX)
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

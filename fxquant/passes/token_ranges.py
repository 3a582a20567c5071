"""Calibrated input ranges over the ordinary tokens, for ``QuantConfig(scheme="static_outliers")`` Linears.

Each such Linear gets a :class:`TokenRangeObserver` in front of it at prepare. Per calibration batch it drops the
*outlier tokens*, the rows of the input whose largest magnitude exceeds :data:`OUTLIER_FACTOR` times the median
row's, and gives the rest to the layer's activation observer (``QuantConfig.activation``), whose range the layer's
input is quantized with at run time; a row outside that range takes its own scale then
(:mod:`fxquant.kernels.static_outliers`). Why the rows are dropped before the range is estimated: on SmolLM2-135M
the first token of a window reaches 2372 at one ``down_proj`` input where the median token reaches 31; a range or
a histogram stretched to it leaves the ordinary tokens a few int8 steps (docs/quantization.md "Schemes" measures
the perplexity). At convert :func:`attach_token_ranges` hands each observer to its layer's node and removes it,
and :func:`~fxquant.passes.schemes.lower_schemes` builds the INT8 layer from it.

The observer also keeps each input channel's min and max over the ordinary tokens. With SmoothQuant
(``smoothquant_alpha``) the layer reads ``x / s``, and the range of that, over the same tokens, is exactly
``[min_j(min_j / s_j), max_j(max_j / s_j)]`` (``s > 0``): :meth:`TokenRangeObserver.smooth` sets it, as
:mod:`fxquant.passes.smoothquant` does for the static scheme's observers.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import torch
from torch import fx, nn

from fxquant.config import QuantConfig
from fxquant.nn.fused import compute_module
from fxquant.observers import MinMaxObserver, Observer, get_activation_observer
from fxquant.passes._graph import finish, nodes_of, only_user
from fxquant.passes._stats import StatisticsObserver, drop_statistics_node, insert_statistics, module_of
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import tensor_input

log = logging.getLogger("fxquant")
SCHEME = "static_outliers"
OUTLIER_FACTOR = 4.0  # a row whose max |x| exceeds this many times the median row's is an outlier token
STATISTICS_PREFIX = "token_range_statistics_"
TOKEN_RANGE = "fxquant_token_range"  # node.meta key: the layer node's calibrated TokenRangeObserver, at convert


def ordinary_rows(rows: torch.Tensor) -> torch.Tensor:
    """Which rows of 2-d ``rows`` are ordinary tokens: bool (rows,), True where the row's largest magnitude is at
    most :data:`OUTLIER_FACTOR` times the median row's."""
    peaks = rows.abs().amax(dim=1)
    return peaks <= OUTLIER_FACTOR * peaks.median()


class TokenRangeObserver(StatisticsObserver):
    """The input range of one Linear over the ordinary tokens of each batch (see the module docstring), and their
    per-channel ``channel_min``/``channel_max``; ``outlier_rows``/``rows`` count what was dropped.
    ``min_val``/``max_val`` keep the full range, for display."""

    outlier_rows: torch.Tensor
    rows: torch.Tensor
    channel_min: torch.Tensor
    channel_max: torch.Tensor

    def __init__(self, in_features: int, activation: Observer) -> None:
        super().__init__()
        self.in_features = in_features
        self.activation = activation
        self.register_buffer("outlier_rows", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("rows", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("channel_min", torch.full((in_features,), math.inf))
        self.register_buffer("channel_max", torch.full((in_features,), -math.inf))

    def _record(self, x: torch.Tensor) -> None:
        """Shapes the Linear cannot take record nothing: the layer, next, raises torch's own error about them."""
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return
        rows = x.reshape(-1, self.in_features)
        lo, hi = torch.aminmax(rows)
        self._check_finite(lo.item(), hi.item())
        ordinary = ordinary_rows(rows)
        kept = rows if bool(ordinary.all()) else rows[ordinary]
        self.activation.update(kept)
        self._channels(kept.amin(dim=0).float(), kept.amax(dim=0).float())
        self.outlier_rows.add_(rows.shape[0] - kept.shape[0])
        self.rows.add_(rows.shape[0])
        self._count(lo, hi, x.numel())

    def _channels(self, low: torch.Tensor, high: torch.Tensor) -> None:
        torch.minimum(self.channel_min, low, out=self.channel_min)
        torch.maximum(self.channel_max, high, out=self.channel_max)

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, TokenRangeObserver)
        self.activation.merge(other.activation)
        self.outlier_rows.add_(other.outlier_rows)
        self.rows.add_(other.rows)
        self._channels(other.channel_min, other.channel_max)

    def smooth(self, inverse: torch.Tensor) -> None:
        """The layer's input is multiplied by ``inverse`` (SmoothQuant's ``1/s``, positive) per channel: its range
        over the ordinary tokens becomes that of the channels' scaled min and max, held by a ``minmax`` observer (the
        activation observer's statistics of the unscaled input say nothing about it)."""
        self.activation = MinMaxObserver.over_channels(self.channel_min * inverse, self.channel_max * inverse,
                                                       self.activation, f"{self.activation.label} (smoothed)")


def insert_token_range_observers(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """Put a :class:`TokenRangeObserver` right before each Linear of ``gm`` on the ``static_outliers`` scheme (in
    place): one per layer, each with an activation observer of the layer's own settings."""
    for node in list(nodes_of(gm)):
        settings = node.meta.get(LAYER_SETTINGS)
        linear = compute_module(module_of(gm, node) or nn.Module())
        value = tensor_input(node)
        if settings is None or settings.quantize or settings.scheme != SCHEME or value is None \
                or not isinstance(linear, nn.Linear):
            continue
        observer = TokenRangeObserver(linear.in_features, get_activation_observer(settings.activation)(
            **settings.observer_options))
        observer.label = f"token ranges of the input of {prefix}{node.target}"
        observer.activation.label = f"the ordinary tokens' range of the input of {prefix}{node.target}"
        insert_statistics(gm, node, value, observer, STATISTICS_PREFIX)
    return finish(gm)


def attach_token_ranges(gm: fx.GraphModule, prefix: str = "") -> fx.GraphModule:
    """Hand each calibrated :class:`TokenRangeObserver` of ``gm`` to its layer's node (``node.meta``) and remove
    its node (in place). A layer whose observer saw no data stays float, with a warning, like every layer whose
    observers saw none (``QuantConfig(unobserved="error")`` refuses at convert's calibration check)."""
    for node in list(nodes_of(gm)):
        observer = module_of(gm, node)
        if not isinstance(observer, TokenRangeObserver):
            continue
        layer = only_user(node)
        if layer is not None and LAYER_SETTINGS in layer.meta:
            if observer.activation.has_data:
                layer.meta[TOKEN_RANGE] = observer
            else:
                log.warning("fxquant: the input of %s%s saw no calibration data: it stays float", prefix, layer.target)
                layer.meta[LAYER_SETTINGS] = replace(layer.meta[LAYER_SETTINGS], scheme="static",
                                                     reason="its observer saw no data during calibration")
        drop_statistics_node(gm, node)
    return finish(gm)


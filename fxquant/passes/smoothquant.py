"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights of the Linear layers they feed.

Per-tensor activation quantization sizes its scale by the largest channel; a few channels 50-100x larger than the
rest (as in transformer activations) leave the others a handful of int8 levels. For ``y = x W^T`` and any
``s_j > 0``, ``y = (x / s) (W * s)^T``: the activation is divided per input channel and the weight columns are
multiplied. With ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)`` the activation channels shrink towards each other
and the weights, quantized per output channel, absorb the range.

Two phases, because ``s`` needs per-channel activation statistics:

* ``prepare`` (``insert_smoothing_observers``, only when ``QuantConfig.smoothquant_alpha`` is set) puts one
  :class:`ChannelRangeObserver` in front of each group of quantized Linear layers reading the same value; calibration
  records each channel's min and max. With ``smoothquant_alpha="auto"`` it also keeps a bounded sample of input
  rows, from which convert chooses one alpha per group (see :mod:`fxquant.passes.smoothquant_auto`).
* ``convert`` (``smooth_activations``) computes ``s`` (one per value, from the weights of every layer in the group),
  scales the weight columns, and divides the activation by ``s`` (:mod:`fxquant.passes.smoothquant_divide`):

  - folded into the producer when the value feeds only the group: a LayerNorm/RMSNorm (weight and bias / s) or a
    Linear (+ ReLU) (output rows and bias / s). Free at inference.
  - otherwise an explicit :class:`ChannelScale` (a float ``x * (1/s)``) in front of a new observer. Its cost is one
    element-wise float multiply of the activation per inference; when the value was int8 already (the output of a
    quantized layer) it also costs a dequantize before and a quantize after it.

  Either way the per-tensor range the smoothed value is quantized with is recomputed exactly from the per-channel
  statistics, ``[min_j(min_j / s_j), max_j(max_j / s_j)]`` (``s > 0``), and used as a ``minmax`` range: a clipping
  observer's histogram of the unsmoothed value says nothing about the smoothed one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from fxquant.config import QuantConfig
from fxquant.errors import CalibrationError
from fxquant.nn.fused import compute_module
from fxquant.observers import MinMaxObserver, Observer
from fxquant.passes._graph import finish, nodes_of, only_user
from fxquant.passes._stats import (
    StatisticsObserver,
    behind_statistics,
    drop_statistics_node,
    is_activation_observer,
    is_quantized_layer,
    module_of,
    unique_name,
)
from fxquant.passes.bias_correction import InputMeanObserver
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import tensor_input
from fxquant.passes.smoothquant_auto import (
    AUTO,
    MIN_SAMPLES,
    SAMPLE_ROWS,
    SMOOTHQUANT_KEY,
    SmoothingChoice,
    choose_alpha,
    keep_smallest_keys,
    sample_rows,
    smoothing_scales,
)
from fxquant.passes.smoothquant_divide import ChannelScale, divide_activation
from fxquant.passes.token_ranges import SCHEME as OUTLIERS_SCHEME
from fxquant.passes.token_ranges import TOKEN_RANGE, TokenRangeObserver
from fxquant.state import STATE_KEY

log = logging.getLogger(__name__)
__all__ = ["ChannelRangeObserver", "ChannelScale", "insert_smoothing_observers", "smooth_activations",
           "smoothing_scales"]

STATISTICS_PREFIX = "smoothquant_statistics_"
SAMPLE_BUFFERS = ("sample_rows", "sample_keys")  # ChannelRangeObserver's: what only "auto"'s choice reads


class ChannelRangeObserver(StatisticsObserver):
    """Per-channel min and max along the last axis (the features a Linear reads): SmoothQuant's statistics.

    With ``samples > 0`` it also keeps a uniform sample of at most ``samples`` input rows (``sample_rows``, with
    their random keys in ``sample_keys``; unfilled slots have key ``inf``): what the automatic alpha needs.
    """

    channel_min: torch.Tensor
    channel_max: torch.Tensor
    sample_rows: torch.Tensor
    sample_keys: torch.Tensor

    def __init__(self, channels: int, samples: int = 0) -> None:
        super().__init__()
        self.register_buffer("channel_min", torch.full((channels,), math.inf))
        self.register_buffer("channel_max", torch.full((channels,), -math.inf))
        self.register_buffer("sample_rows", torch.zeros(samples, channels))
        self.register_buffer("sample_keys", torch.full((samples,), math.inf))

    def _update(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        channels = self.channel_min.numel()
        if x.dim() == 0 or x.shape[-1] != channels:
            raise CalibrationError(f"{self.label}: expected {channels} features on the last axis, got a tensor of "
                                   f"shape {tuple(x.shape)}")
        low, high = torch.aminmax(x.reshape(-1, channels).float(), dim=0)
        self.channel_min.copy_(torch.minimum(self.channel_min, low))
        self.channel_max.copy_(torch.maximum(self.channel_max, high))
        if self.sample_keys.numel():
            sample_rows(self.sample_rows, self.sample_keys, x, seed=int(self.num_updates))

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, ChannelRangeObserver)
        self.channel_min.copy_(torch.minimum(self.channel_min, other.channel_min))
        self.channel_max.copy_(torch.maximum(self.channel_max, other.channel_max))
        if self.sample_keys.numel():
            keep_smallest_keys(self.sample_rows, self.sample_keys, other.sample_rows, other.sample_keys)

    def samples(self) -> torch.Tensor:
        """The sampled input rows (``[rows, channels]``)."""
        return self.sample_rows[torch.isfinite(self.sample_keys)]

    def recorded_state(self) -> dict[str, torch.Tensor]:
        """The state dict a converted model keeps once ``"auto"``'s choice is recorded: the sampled rows left empty
        (only the choice reads them, and on an LLM they weigh about as much as its INT8 weights)."""
        return {key: value[:0] if key in SAMPLE_BUFFERS else value for key, value in self.state_dict().items()}

    def take_recorded(self, key: str, value: torch.Tensor) -> bool:
        """Take an empty sample buffer :meth:`recorded_state` saved (a loaded model's; its choices come recorded)."""
        if key not in SAMPLE_BUFFERS or value.numel() or value.dim() != getattr(self, key).dim():
            return False
        self.register_buffer(key, value.clone())
        return True

    def absmax(self) -> torch.Tensor:
        return torch.maximum(-self.channel_min, self.channel_max).clamp(min=0.0)


def _linear(gm: fx.GraphModule, node: fx.Node) -> nn.Linear:
    layer = compute_module(gm.get_submodule(str(node.target)))
    assert isinstance(layer, nn.Linear)
    return layer


def _outliers_layer(node: fx.Node) -> bool:
    """A Linear on the ``static_outliers`` scheme: float in and out, its input range calibrated per token."""
    settings = node.meta.get(LAYER_SETTINGS)
    return settings is not None and settings.scheme == OUTLIERS_SCHEME and not settings.quantize


def _smoothable(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A Linear (maybe fused with its activation) with a tensor input, quantized with an observed output or on the
    ``static_outliers`` scheme."""
    module = module_of(gm, node)
    if module is None or not isinstance(compute_module(module), nn.Linear) or tensor_input(node) is None:
        return False
    return _outliers_layer(node) or (is_quantized_layer(node) and is_activation_observer(gm, only_user(node)))


def insert_smoothing_observers(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """Put a :class:`ChannelRangeObserver` before each group of quantized Linears reading one value (in place)."""
    if config.smoothquant_alpha is None:
        return gm
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes_of(gm):
        value = tensor_input(node)
        if value is not None and _smoothable(gm, node):
            groups.setdefault(value, []).append(node)
    for value, layers in groups.items():
        widths = {_linear(gm, n).in_features for n in layers}
        if len(widths) != 1:
            continue
        observer = ChannelRangeObserver(widths.pop(), SAMPLE_ROWS if config.smoothquant_alpha == AUTO else 0)
        observer.label = f"SmoothQuant statistics of the input of {', '.join(prefix + str(n.target) for n in layers)}"
        name = unique_name(gm, STATISTICS_PREFIX)
        gm.add_submodule(name, observer)
        with gm.graph.inserting_after(value):
            statistics = gm.graph.call_module(name, (value,))
        for layer in layers:
            layer.replace_input_with(value, statistics)
    return finish(gm)


def _resolve_alpha(statistics: ChannelRangeObserver, weights: list[torch.Tensor], layer_nodes: list[fx.Node],
                   alpha: float | str) -> tuple[float | None, dict[float | None, float]]:
    """The configured alpha, or for ``"auto"`` the group's best candidate on its sampled rows."""
    if alpha != AUTO:
        return float(alpha), {}
    schemes = [n.meta[LAYER_SETTINGS].weight for n in layer_nodes]
    rows = statistics.samples()
    if rows.shape[0] < MIN_SAMPLES:
        log.warning("SmoothQuant auto: %s saw only %d input rows, too few to choose an alpha; left unsmoothed",
                    statistics.label, rows.shape[0])
        return None, {}
    return choose_alpha(rows, list(zip(weights, schemes, strict=True)),
                        outlier_tokens=all(_outliers_layer(n) for n in layer_nodes))


@torch.no_grad()
def _smooth(gm: fx.GraphModule, node: fx.Node, statistics: ChannelRangeObserver, alpha: float | str,
            recorded: Mapping[str, float | None]) -> SmoothingChoice | None:
    layer_nodes = [behind_statistics(gm, user) for user in node.users]
    layers = [compute_module(module_of(gm, n) or nn.Module()) for n in layer_nodes]
    weights = [layer.weight for layer in layers  # a reparametrized weight is computed: it cannot be rescaled
               if isinstance(layer, nn.Linear) and not parametrize.is_parametrized(layer, "weight")]
    if len(weights) != len(layer_nodes):
        return None
    names = ", ".join(str(n.target) for n in layer_nodes)
    first = str(layer_nodes[0].target)
    errors: dict[float | None, float] = {}
    if alpha == AUTO and first in recorded:  # a choice made before (a saved model's), not made again
        chosen = recorded[first]
    else:
        chosen, errors = _resolve_alpha(statistics, weights, layer_nodes, alpha)
    choice = SmoothingChoice(tuple(str(n.target) for n in layer_nodes), chosen, errors)
    if errors:
        log.info("SmoothQuant auto: input of %s: alpha=%s (relative output error %.3g; unsmoothed %.3g)", names,
                 "none" if chosen is None else f"{chosen:g}", errors[chosen], errors[None])
    if chosen is None:
        return choice
    scales = smoothing_scales(statistics.absmax(), torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0),
                              chosen)
    for layer in layers:  # a new tensor each: a weight tied to another module (an LM head's to the embedding)
        assert isinstance(layer, nn.Linear)  # must not change there
        layer.weight = nn.Parameter(layer.weight.detach() * scales, requires_grad=layer.weight.requires_grad)
    for user in node.users:  # bias-correction statistics between here and the layer saw the unsmoothed value
        module = module_of(gm, user)
        if isinstance(module, InputMeanObserver):
            module.rescale_channels(1.0 / scales)
    for layer_node in layer_nodes:  # so did a static_outliers layer's token ranges
        token_range = layer_node.meta.get(TOKEN_RANGE)
        if isinstance(token_range, TokenRangeObserver):
            token_range.smooth(1.0 / scales)
    observer = None if all(_outliers_layer(n) for n in layer_nodes) else MinMaxObserver.over_channels(
        statistics.channel_min / scales, statistics.channel_max / scales, statistics, f"input of {names} (smoothed)")
    divide_activation(gm, node, scales, observer)
    return choice


def smooth_activations(gm: fx.GraphModule, config: QuantConfig,
                       recorded: Mapping[str, float | None] | None = None) -> fx.GraphModule:
    """Apply SmoothQuant from the calibrated :class:`ChannelRangeObserver` nodes of ``gm`` and remove them (in place).

    Called by ``convert`` on its copy of the prepared model, before lowering. What was done to each Linear is kept in
    ``gm.meta`` (read it with :func:`~fxquant.passes.smoothquant_auto.smoothquant_alphas`). ``recorded`` (layer path
    -> alpha, as ``smoothquant_alphas`` gives them; ``QuantState.smoothquant_alphas``) replays ``"auto"``'s choices
    for the groups whose first layer it names instead of choosing again: a converted model keeps the choices, not the
    sampled rows they were made on (:meth:`ChannelRangeObserver.recorded_state`). Example::

        prepared = fxquant.prepare(model, example, QuantConfig(smoothquant_alpha=0.5))   # or "auto"
        fxquant.calibrate(prepared, data)
        qmodel = fxquant.convert(prepared)      # smoothing happens here
    """
    prefix = getattr(gm.meta.get(STATE_KEY), "prefix", "")
    local = {path.removeprefix(prefix): alpha for path, alpha in (recorded or {}).items() if path.startswith(prefix)}
    choices: dict[str, SmoothingChoice] = {}
    for node in nodes_of(gm):
        statistics = module_of(gm, node)
        if not isinstance(statistics, ChannelRangeObserver):
            continue
        if config.smoothquant_alpha is not None and statistics.has_data and node.users:
            choice = _smooth(gm, node, statistics, config.smoothquant_alpha, local)
            if choice is not None:
                full = SmoothingChoice(tuple(prefix + n for n in choice.layers), choice.alpha, choice.errors)
                choices.update({path: full for path in full.layers})
        drop_statistics_node(gm, node)
    if choices:
        gm.meta[SMOOTHQUANT_KEY] = choices
    return finish(gm)

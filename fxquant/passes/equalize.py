"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", 2019): balance per-channel weight ranges.

Per-tensor weight quantization gives every output channel one scale; when one channel's weights are 50x larger than
the others', the others keep a handful of int8 levels. For two layers ``y = B(act(A(x)))`` where ``act`` is ReLU or
the identity, dividing output channel ``i`` of ``A`` (weights and bias) by ``s_i > 0`` and multiplying input channel
``i`` of ``B`` by ``s_i`` computes the same function, because ``relu(z / s) = relu(z) / s``. With
``s_i = sqrt(r1_i / r2_i)`` (``r1_i``: max |weight| of A's output channel i, ``r2_i``: of B's input channel i) both
ranges become ``sqrt(r1_i * r2_i)``: balanced. Chains (expand -> depthwise -> project) are swept until the scales
settle. Depthwise and grouped convolutions are handled through the group layout of B's weight.

What is *not* equalized, and why:

* pairs joined through ReLU6/hardtanh: ``clamp(z / s, 0, 6) != clamp(z, 0, 6) / s``. Keeping the float function
  exact would need a per-channel clamp bound ``6 / s_i``, which no int8 kernel applies (they clamp the whole tensor
  by saturating at the output range), so such pairs are skipped; replace ReLU6 by ReLU first if that is acceptable.
* a layer whose output has several users (a residual, a branch): scaling it would change the other users' inputs.
* transposed convolutions, Conv -> Linear through a flatten, and layers kept float by the config.

The pass runs in ``prepare`` (``QuantConfig(equalize=True)``) before observers are inserted, so calibration sees the
equalized activations; it changes weights only, never the graph.
"""

from __future__ import annotations

import logging

import torch
from torch import fx, nn

from fxquant.config import QuantConfig
from fxquant.nn.fused import Fused, compute_module
from fxquant.passes._graph import modules_of, nodes_of, only_user
from fxquant.passes.insert_observers import resolve_layer_settings
from fxquant.passes.meta import LAYER_SETTINGS

log = logging.getLogger(__name__)

MAX_SWEEPS = 20
TOLERANCE = 1e-4  # stop sweeping when no scale moves further than this from 1
Layer = nn.Linear | nn.modules.conv._ConvNd


def _equalizable(module: nn.Module) -> Layer | None:
    """The Linear/Conv inside ``module`` when its output may be rescaled per channel (identity or ReLU after it)."""
    layer = compute_module(module)
    if layer is None or isinstance(layer, nn.modules.conv._ConvTransposeNd):
        return None
    if isinstance(module, Fused) and not (module.min_val == 0.0 and module.max_val is None):
        return None  # a clamp bound (ReLU6, hardtanh) would have to move per channel: see the module docstring
    return layer


def _groups(layer: Layer) -> int:
    return layer.groups if isinstance(layer, nn.modules.conv._ConvNd) else 1


def _in_channels(layer: Layer) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels


def _grouped_view(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A weight as (groups, out per group, in per group, rest): input channel ``g * in_per_group + j`` is [g, :, j]."""
    return weight.view(groups, weight.shape[0] // groups, weight.shape[1], -1)


def output_ranges(layer: Layer) -> torch.Tensor:
    """``r1``: max |weight| of each output channel."""
    return layer.weight.detach().abs().flatten(1).amax(dim=1)


def input_ranges(layer: Layer) -> torch.Tensor:
    """``r2``: max |weight| over everything that reads each input channel (group layout respected)."""
    return _grouped_view(layer.weight.detach(), _groups(layer)).abs().amax(dim=(1, 3)).reshape(-1)


def equalization_scales(r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """``s = sqrt(r1 * r2) / r2``: both ranges become ``sqrt(r1 * r2)``; dead channels (a zero range) keep s = 1."""
    live = (r1 > 0) & (r2 > 0)
    return torch.where(live, torch.sqrt(r1 / torch.where(live, r2, 1.0)), torch.ones_like(r1))


@torch.no_grad()
def equalize_pair(first: Layer, second: Layer) -> float:
    """Rescale ``first``'s output channels by 1/s and ``second``'s input channels by s; returns max |s - 1|."""
    scales = equalization_scales(output_ranges(first), input_ranges(second))
    shape = (-1,) + (1,) * (first.weight.dim() - 1)
    first.weight.div_(scales.reshape(shape))
    if first.bias is not None:
        first.bias.div_(scales)
    groups = _groups(second)
    _grouped_view(second.weight, groups).mul_(scales.reshape(groups, 1, -1, 1))
    return float((scales - 1).abs().max()) if scales.numel() else 0.0


def _quantized(node: fx.Node) -> bool:
    settings = node.meta.get(LAYER_SETTINGS)  # unresolved (a bare fused graph): every layer counts
    return settings is None or bool(settings.quantize)


def equalizable_pairs(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """``(first, second)`` module paths of every Linear->Linear / Conv->Conv pair CLE may rescale, in graph order."""
    modules = modules_of(gm)
    pairs = []
    for node in nodes_of(gm):
        user = only_user(node)
        if node.op != "call_module" or user is None or user.op != "call_module" or not user.args:
            continue
        first = _equalizable(modules[str(node.target)])
        second = compute_module(modules[str(user.target)])
        if first is None or second is None or user.args[0] is not node or not (_quantized(node) and _quantized(user)):
            continue
        if type(first) is type(second) and first.weight.shape[0] == _in_channels(second):
            pairs.append((str(node.target), str(user.target)))
    return pairs


def equalize_layers(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """Cross-layer equalization of ``gm``'s layer pairs (in place) when ``config.equalize``; returns ``gm``.

    Example::

        prepared = fxquant.prepare(model, example, QuantConfig(weight="per_tensor", equalize=True))
    """
    if not config.equalize:
        return gm
    resolve_layer_settings(gm, config, prefix)  # only layers that will be quantized are worth rescaling
    pairs = [(compute_module(gm.get_submodule(a)), compute_module(gm.get_submodule(b)))
             for a, b in equalizable_pairs(gm)]
    sweeps = 0
    while pairs and sweeps < MAX_SWEEPS:
        sweeps += 1
        if max(equalize_pair(a, b) for a, b in pairs if a is not None and b is not None) < TOLERANCE:
            break
    log.info("cross-layer equalization: %d layer pairs, %d sweeps", len(pairs), sweeps)
    return gm

"""Multiply-adds per layer for one forward pass: what coverage weighs INT8 layers by.

A count of modules overstates coverage when the float ones are the big ones (an ``lm_head`` over a large
vocabulary, the first conv of a CNN at full resolution), so coverage also reports the fraction of multiply-adds that
run INT8 for the example inputs. Each layer's count comes from its weight's shape and the shapes it saw, recorded by
forward hooks on one call of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fxquant.nn.fused import Fused
from fxquant.nn.layers import is_transposed_linear, layer_kind
from fxquant.nn.quantized import QuantizedConvTransposeNd, _QuantizedWeighted
from fxquant.nn.schemes import SchemeLinear


def _weight(module: nn.Module) -> torch.Tensor | None:
    inner = module.inner if isinstance(module, Fused) else module
    weight = getattr(inner, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def layer_macs(module: nn.Module, args: tuple[Any, ...], output: Any) -> int:
    """The multiply-adds of one call of a Linear/conv-like ``module`` (float or INT8) that read ``args[0]`` and
    returned ``output``; 0 for lookups and for calls whose shapes say nothing (no tensor)."""
    x = args[0] if args else None
    inner = module.inner if isinstance(module, Fused) else module
    if isinstance(inner, SchemeLinear):  # its float ``weight`` is made on access: count from its sizes
        return output.numel() * inner.in_features if isinstance(output, torch.Tensor) else 0
    if isinstance(module, nn.MultiheadAttention) and isinstance(x, torch.Tensor):
        return x.numel() // module.embed_dim * 4 * module.embed_dim ** 2  # q, k, v and output projections
    weight = _weight(module)
    if weight is None or not isinstance(output, torch.Tensor) or layer_kind(module) in ("Embedding", "EmbeddingBag"):
        return 0
    if is_transposed_linear(inner):
        return output.numel() * weight.shape[0]
    if isinstance(inner, (nn.modules.conv._ConvTransposeNd, QuantizedConvTransposeNd)):
        return (x.numel() if isinstance(x, torch.Tensor) else 0) * math.prod(weight.shape[1:])
    return output.numel() * math.prod(weight.shape[1:])


def counted(module: nn.Module) -> bool:
    """Whether coverage counts ``module``'s multiply-adds: an INT8 layer or a float layer kind."""
    inner = module.inner if isinstance(module, Fused) else module
    return isinstance(inner, (_QuantizedWeighted, SchemeLinear)) or layer_kind(inner) not in (None, "Embedding",
                                                                                            "EmbeddingBag")


@contextmanager
def counting_macs(model: nn.Module) -> Iterator[dict[int, int]]:
    """Within the block, every call of a counted layer of ``model`` adds its multiply-adds to the yielded dict,
    keyed by ``id(module)``; a layer inside another counted layer (a Fused module's inner) is counted once."""
    counts: dict[int, int] = {}
    handles = []
    inner_ids = {id(m.inner) for m in model.modules() if isinstance(m, Fused)}
    for module in model.modules():
        if counted(module) and id(module) not in inner_ids:
            def hook(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                counts[id(m)] = counts.get(id(m), 0) + layer_macs(m, args, output)

            handles.append(module.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def model_macs(model: nn.Module, example_inputs: tuple[Any, ...]) -> dict[int, int]:
    """Multiply-adds per layer (by ``id``) for one call of ``model`` on ``example_inputs``."""
    with counting_macs(model) as counts, torch.no_grad():
        model(*example_inputs)
    return counts

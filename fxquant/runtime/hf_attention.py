"""The attention a converted transformers model runs: fxquant's attention loops where they compute what
transformers' SDPA function would, that function for every other call.

Once a model's Linears are INT8, attention is a large share of the time left (docs/benchmarks.md, "Decoder LLMs"),
and torch's CPU flash attention uses a fraction of the core's float32 rate; :mod:`fxquant.runtime.attention` picks
fxquant's loops for the calls they compute ("Causal prefill attention", "Attention over every key" there).

transformers picks a model's attention function by name from its ``AttentionInterface`` registry, and the mask
builder by the same name from ``AttentionMaskInterface``. :func:`use_fast_attention` registers :func:`attention`
as :data:`NAME` (with transformers' SDPA mask builder) and switches a model whose implementation is ``"sdpa"`` to
it with transformers' own ``set_attn_implementation``, so ``qmodel.set_attn_implementation("sdpa")`` switches it
back. :func:`attention` decides causality as ``sdpa_attention_forward`` does (causal only for more than one query
and no mask) and takes a loop where one computes the same function: an unpadded prefill (the causal loop), a padded
batch (its mask) or a decode step (one query over the cache: the full loop), float32 on the CPU, no dropout,
softcap, attention sinks, position bias or attention weights asked for, a head dim the loops take, no autograd, not
under a tracer or compiler. Everything else goes to ``sdpa_attention_forward`` unchanged. ``convert`` calls
:func:`attention_for_backend`: the reference backend, torch's own arithmetic by design, and a model with no INT8
layer left keep ``"sdpa"``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from fxquant.nn.quantized import _BackendModule
from fxquant.nn.schemes import SchemeLinear
from fxquant.runtime.attention import fast_attention

NAME = "fxquant_sdpa"  # the attn_implementation name of :func:`attention` in transformers' registries
_DECLINED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")  # what the loop does not compute


def _fast(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
          kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A loop's output (batch, tokens, heads, dim) where one computes what ``sdpa_attention_forward`` would, else
    None. Its causal flag as transformers decides it: causal only for more than one query and no mask."""
    if kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _DECLINED_KWARGS):
        return None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and bool(causal)
    if attention_mask is not None and attention_mask.dim() == 4:  # transformers' own slice to the keys
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = fast_attention(query, key, value, attention_mask, dropout, causal, scaling, enable_gqa=True)
    return None if out is None else out.transpose(1, 2)


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature (``AttentionInterface``): query (batch, heads, tokens, dim), key
    and value (batch, kv_heads, kv_tokens, dim) in, ``(output (batch, tokens, heads, dim), None)`` out, as
    ``sdpa_attention_forward`` returns them."""
    out = _fast(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if out is not None:
        return out, None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def attention_for_backend(model: nn.Module, backend: str) -> nn.Module:
    """``model`` (converted) on :data:`NAME` (:func:`use_fast_attention`) where it runs INT8 layers on a kernel
    backend, else on ``"sdpa"`` (a model switched to :data:`NAME` goes back): the reference backend computes with
    torch's own ops by design (what an exported ``.pt2`` computes, and what tests compare with), and a model with
    every layer kept float (``keep_float=["*"]``) must be the float computation bit for bit."""
    if backend != "reference" and any(isinstance(m, (_BackendModule, SchemeLinear)) for m in model.modules()):
        return use_fast_attention(model)
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    return model


def use_fast_attention(model: nn.Module) -> nn.Module:
    """``model``, switched to :data:`NAME` where it is a transformers model whose attention is ``"sdpa"`` (its
    default on torch); any other model as it is. Registers :data:`NAME` with transformers first (idempotent)."""
    transformers = sys.modules.get("transformers")  # a transformers model has imported it; nothing else needs it
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return model
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return model
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    transformers.AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return model

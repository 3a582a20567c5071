"""The attention a converted transformers model runs: fxquant's causal attention loop for a decoder's prefill,
transformers' own SDPA function for every other call.

A decoder's prefill of 512 tokens spends a third of an INT8 model's time in attention once its Linears are INT8
(docs/benchmarks.md, "Decoder LLMs"), and torch's CPU flash attention reaches about a third of the core's float32
rate there. :mod:`fxquant.native.attention` computes the same function in one blocked pass at about twice its speed.

transformers picks a model's attention function by name from its ``AttentionInterface`` registry, and the mask
builder by the same name from ``AttentionMaskInterface``. :func:`use_fast_attention` registers :func:`attention`
as :data:`NAME` (with transformers' SDPA mask builder) and switches a model whose implementation is ``"sdpa"`` to
it with transformers' own ``set_attn_implementation``, so ``qmodel.set_attn_implementation("sdpa")`` switches it
back. :func:`attention` takes the loop only where SDPA itself would run its causal kernel and the loop computes the
same function: no mask (transformers passes none for an unpadded causal prefill), more than one query, float32 on
the CPU, no dropout, softcap, attention sinks, position bias or attention weights asked for, a head dim the loop
takes, no autograd, not under a tracer or compiler. Everything else goes to ``sdpa_attention_forward`` unchanged:
a decode step (one query), a padded batch (a mask), another dtype. ``convert`` calls
:func:`attention_for_backend`: the reference backend, torch's own arithmetic by design, and a model with no INT8
layer left keep ``"sdpa"``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from fxquant.native.attention import MAX_DIM, causal_attention_into
from fxquant.nn.quantized import _BackendModule
from fxquant.nn.schemes import SchemeLinear

NAME = "fxquant_sdpa"  # the attn_implementation name of :func:`attention` in transformers' registries
_DECLINED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")  # what the loop does not compute


def _fast(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, is_causal: bool | None,
          kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The loop's output (batch, tokens, heads, dim) where it computes what SDPA would, else None."""
    if (attention_mask is not None or dropout or query.shape[2] < 2 or key.shape[2] < query.shape[2]
            or not (is_causal if is_causal is not None else getattr(module, "is_causal", True))
            or kwargs.get("output_attentions") or any(kwargs.get(name) is not None for name in _DECLINED_KWARGS)):
        return None
    tensors = (query, key, value)
    if (not all(type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 4
                and t.stride(-1) == 1 for t in tensors)
            or query.shape[-1] % 16 or query.shape[-1] > MAX_DIM or query.shape[1] % key.shape[1]
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            or torch.compiler.is_compiling() or torch.jit.is_tracing()):  # (an fx Proxy is not a Tensor)
        return None
    tokens = query.shape[2]  # SDPA's causal mask is aligned top-left: it, too, keeps only the first tokens' keys
    key, value = key[:, :, :tokens], value[:, :, :tokens]
    batch, heads, _, dim = query.shape
    out = torch.empty(batch, tokens, heads, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    return out if causal_attention_into(out.transpose(1, 2), query, key, value, scale) else None


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

"""The attention a converted model runs: fxquant's float32 attention loops where they compute what
``F.scaled_dot_product_attention`` would, torch's SDPA for every other call.

Once a transformer's Linears are INT8, its float attention is a large share of the time that is left, and torch's
CPU flash kernel, which SDPA runs, uses a fraction of the core's float32 rate at encoder shapes;
:func:`fxquant.native.attention.full_attention_into` computes the same function with register-tiled products
(docs/benchmarks.md, "Attention over every key", has the measurements). The graph walk
(:mod:`fxquant.runtime.runner`) calls :func:`scaled_dot_product_attention` for a graph's SDPA nodes where the model
runs INT8 layers on a kernel backend (:func:`runs_fast`); the graph and its generated code keep torch's SDPA, so an
export, a traced or hooked call and the reference backend (torch's own arithmetic by design) compute with torch's
kernel.

A call takes a loop only where it computes the same function: float32 on the CPU, 4-d query, key and value dense
along the head dim, a head dim the loops take, the same head dim for values, no dropout, no autograd, not under a
tracer or compiler; a mask (bool, or float32 added to the scores) broadcasting to (batch, heads, queries, keys) and
dense along the keys, or ``is_causal`` without one (:func:`fxquant.native.attention.causal_attention_into`);
grouped-query heads only with ``enable_gqa``, as SDPA asks. Results differ from SDPA's by float32 rounding only (the
loops sum in another order; tests/native/test_full_attention.py compares both with a float64 reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxquant.native.attention import MAX_DIM, causal_attention_into, full_attention_into
from fxquant.nn.quantized import _BackendModule

SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)  # what traced graphs call


def runs_fast(model: nn.Module) -> bool:
    """Whether ``model`` runs INT8 layers on a kernel backend (not the reference one), where its SDPA calls take
    :func:`scaled_dot_product_attention`."""
    return any(isinstance(m, _BackendModule) and m.backend.name != "reference" for m in model.modules())


def _loop_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                enable_gqa: bool) -> bool:
    tensors = (query, key, value)
    if not all(type(t) is torch.Tensor and t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 4
               and t.stride(-1) == 1 for t in tensors):
        return False
    batch, heads, _, dim = query.shape
    return (not dropout_p and dim % 16 == 0 and dim <= MAX_DIM and key.shape[-1] == dim and value.shape[-1] == dim
            and key.shape[0] == batch and value.shape[:3] == key.shape[:3] and heads % key.shape[1] == 0
            and (heads == key.shape[1] or enable_gqa)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


def _mask4d(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``mask`` as the loop reads it, (batch or 1, heads or 1, queries or 1, keys) dense along the keys; None where
    it is not such a mask."""
    if type(mask) is not torch.Tensor or mask.dtype not in (torch.bool, torch.float32) or mask.device.type != "cpu":
        return None
    if mask.dim() > 4 or mask.dim() < 1 or mask.requires_grad:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask
    full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if mask.shape[-1] != full[-1] or mask.stride(-1) != 1 or any(
            size not in (1, want) for size, want in zip(mask.shape[:3], full[:3], strict=True)):
        return None
    return mask


def fast_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor | None:
    """SDPA's output, laid out as ``query`` (as torch's CPU kernel lays it out), from a loop; None where no loop
    computes this call (module docstring)."""
    if not _loop_takes(query, key, value, dropout_p, enable_gqa):
        return None
    mask = None if attn_mask is None else _mask4d(attn_mask, query, key)
    if (attn_mask is not None and (mask is None or is_causal)) or (is_causal and key.shape[2] < query.shape[2]):
        return None
    out = torch.empty_like(query)  # a dense query's strides (a transposed view's too), else contiguous
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    if is_causal:  # SDPA's causal mask is aligned top-left: query t sees keys 0 .. t
        tokens = query.shape[2]
        done = causal_attention_into(out, query, key[:, :, :tokens], value[:, :, :tokens], scale)
    else:
        done = full_attention_into(out, query, key, value, scale, mask)
    return out if done else None


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s signature and function, on a loop where one computes it."""
    out = fast_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

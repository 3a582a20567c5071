"""Typed wrappers of the attention loops in float32: the causal one (``fxquant/native/csrc/attention.c``), softmax(q
k^T * scale, causal) v for a decoder's prefill in one pass that never stores the scores, and the full one
(``full_attention.c``), softmax(q k^T * scale + mask) v over every key for an encoder (the converted models'
attention: :mod:`fxquant.runtime.hf_attention`, :mod:`fxquant.runtime.attention`)."""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.loader import extension

MAX_DIM = 256  # head dims the loops take: multiples of 16 up to this (FXQ_ATTENTION_MAX_DIM)
_MASK_NONE, _MASK_ADD, _MASK_KEEP = 0, 1, 2  # FXQ_MASK_*: no mask, float32 added to the scores, bool kept


def _heads(t: torch.Tensor) -> tuple[int, int, int, int]:
    return t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)


def causal_attention_into(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          scale: float) -> bool:
    """``out`` (batch, heads, tokens, dim) = softmax(query key^T * scale + causal mask) value, the mask aligned
    top-left (query t sees keys 0 .. t), from float32 ``query`` (batch, heads, tokens, dim) and ``key``, ``value``
    (batch, kv_heads, tokens, dim), heads a multiple of kv_heads (grouped-query attention). Every tensor float32 on
    the CPU with unit stride along dim, any other strides; dim a multiple of 16 up to :data:`MAX_DIM`. False
    (nothing written) where the loop cannot run: no C extension, no AVX-512, or ``FXQUANT_ISA`` below it."""
    if loader.loops_for("attention") is None:
        return False
    batch, heads, tokens, dim = query.shape
    return extension.causal_attention_f32(_heads(query), _heads(key), _heads(value), _heads(out),
                                          (batch, heads, key.shape[1], tokens, dim), scale)


def full_attention_into(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> bool:
    """``out`` (batch, heads, q_tokens, dim) = softmax(query key^T * scale + mask) value over every key, from float32
    ``query`` (batch, heads, q_tokens, dim) and ``key``, ``value`` (batch, kv_heads, kv_tokens, dim), as
    :func:`causal_attention_into` takes them. ``mask``: None, float32 (added to the scores) or bool (True: the key
    is seen), of shape (batch, heads, q_tokens, kv_tokens) or broadcasting to it (size-1 dims), dense along the
    keys; a row whose every key is masked out gets zeros, as torch's CPU kernel gives. False (nothing written)
    where the loop cannot run: no C extension, no AVX-512, or ``FXQUANT_ISA`` below it."""
    if loader.loops_for("attention") is None:
        return False
    batch, heads, q_tokens, dim = query.shape
    mask_args = (0, _MASK_NONE, 0, 0, 0)
    if mask is not None:  # a size-1 dim broadcasts: stride 0
        b, h, r = (0 if size == 1 else step for size, step in zip(mask.shape[:3], mask.stride()[:3], strict=True))
        mask_args = (mask.data_ptr(), _MASK_KEEP if mask.dtype == torch.bool else _MASK_ADD, b, h, r)
    return extension.full_attention_f32(_heads(query), _heads(key), _heads(value), _heads(out), mask_args,
                                        (batch, heads, key.shape[1], q_tokens, key.shape[2], dim), scale)

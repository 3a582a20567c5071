"""Typed wrapper of the causal attention loop (``fxquant/native/csrc/attention.c``): softmax(q k^T * scale, causal)
v in float32 for a decoder's prefill, in one pass that never stores the scores (the converted transformers
models' attention, :mod:`fxquant.runtime.hf_attention`)."""

from __future__ import annotations

import torch

from fxquant.native import loader
from fxquant.native.loader import extension

MAX_DIM = 256  # head dims the loop takes: multiples of 16 up to this (FXQ_ATTENTION_MAX_DIM)


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

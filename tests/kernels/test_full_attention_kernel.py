"""The full attention loop (``fxquant/native/csrc/full_attention.c``,
:func:`fxquant.native.attention.full_attention_into`) against softmax(q k^T * scale + mask) v computed in float64
with torch's ops.

Shapes reach the loop's edges: a last block of fewer than 32 query rows and register tiles of 1-3 rows, keys not a
multiple of 16 (the transposed keys' zero rows and the softmax's tail), head dims of 1-4 vectors and above 64,
one query (a decode step), more keys than queries (cross-attention), grouped-query heads; inputs are strided views
(the transposed layout traced models and transformers make). Masks: bool (a padded batch, broadcast over heads and
queries), float added to the scores (transformers' finfo.min padding, a full per-head bias), a row masked out
entirely (zeros, as torch's CPU kernel gives; finfo.min alone averages, as it does there). The loop sums in float32
with fused multiply-adds: errors are bounded, not zero (measured at most 2e-6 on unit-scale values).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_contract_cases import require_c_loops, require_loop

from fxquant import native
from fxquant.native.attention import full_attention_into
from fxquant.native.loader import extension
from fxquant.report.latency import num_threads

TOLERANCE = 2e-5  # absolute, on outputs of unit scale


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               mask: torch.Tensor | None = None) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-2, -1) * scale
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.double()
    probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with every key masked: zeros
    return probabilities @ v


def _inputs(batch: int, heads: int, kv_heads: int, q_tokens: int, kv_tokens: int,
            dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each (batch, tokens, heads, dim) transposed to (batch, heads, tokens, dim), as a traced encoder makes them."""
    q = torch.randn(batch, q_tokens, heads, dim).transpose(1, 2)
    k = torch.randn(batch, kv_tokens, kv_heads, dim).transpose(1, 2)
    v = torch.randn(batch, kv_tokens, kv_heads, dim).transpose(1, 2)
    return q, k, v


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    assert full_attention_into(out, q, k, v, scale, mask)  # the loop ran: it writes and says so
    return out


@pytest.mark.parametrize("shape", [(8, 4, 4, 128, 128, 64), (1, 12, 12, 197, 197, 64), (2, 3, 3, 33, 33, 32),
                                   (1, 2, 2, 1, 77, 64), (1, 4, 4, 7, 1500, 48), (3, 2, 2, 5, 5, 16),
                                   (1, 2, 1, 40, 40, 256), (2, 8, 2, 19, 23, 80), (1, 1, 1, 64, 16, 128)])
def test_the_loop_computes_attention_over_every_key(shape: tuple[int, int, int, int, int, int]) -> None:
    require_loop("the attention loop", "avx512f", "avx512")
    q, k, v = _inputs(*shape)
    scale = shape[-1] ** -0.5
    assert (_run(q, k, v, scale).double() - _reference(q, k, v, scale)).abs().max().item() < TOLERANCE


def _padding(batch: int, q_tokens: int, kv_tokens: int) -> torch.Tensor:
    """(batch, 1, q_tokens, kv_tokens) bool, expanded as transformers' mask builder makes it: batch row 1 sees only
    its first 5 keys, and the last batch row none."""
    keep = torch.ones(batch, 1, 1, kv_tokens, dtype=torch.bool)
    keep[1, ..., 5:] = False
    keep[-1] = False
    return keep.expand(batch, 1, q_tokens, kv_tokens)


@pytest.mark.parametrize("kind", ["bool", "bool_full", "finfo_min", "bias", "minus_inf"])
def test_masks_are_applied_as_torch_applies_them(kind: str) -> None:
    require_loop("the attention loop", "avx512f", "avx512")
    batch, heads, q_tokens, kv_tokens = 3, 4, 21, 37
    q, k, v = _inputs(batch, heads, heads, q_tokens, kv_tokens, 64)
    keep = _padding(batch, q_tokens, kv_tokens)
    masks = {"bool": keep, "bool_full": keep.expand(batch, heads, q_tokens, kv_tokens).contiguous(),
             "finfo_min": torch.where(keep, 0.0, torch.finfo(torch.float32).min),
             "bias": torch.randn(batch, heads, q_tokens, kv_tokens) * 3,
             "minus_inf": torch.where(keep, 0.0, float("-inf"))}
    mask = masks[kind]
    out = _run(q, k, v, 0.125, mask)
    # finfo.min alone leaves every score of the last batch row equal: an average of the values, as torch gives
    if kind == "finfo_min":
        reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(),
                                                   scale=0.125)
    else:
        reference = _reference(q, k, v, 0.125, mask)
    assert (out.double() - reference).abs().max().item() < TOLERANCE
    if kind in ("bool", "bool_full", "minus_inf"):
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # every key masked: zeros, as torch's CPU kernel


def test_huge_scores_stay_exact_to_rounding() -> None:
    """A scale of 40 puts scores in the hundreds, where an unshifted exp overflows float32."""
    require_loop("the attention loop", "avx512f", "avx512")
    q, k, v = _inputs(1, 4, 4, 70, 70, 64)
    out = _run(q, k, v, 40.0)
    assert torch.isfinite(out).all()
    assert (out.double() - _reference(q, k, v, 40.0)).abs().max().item() < 2e-4


@pytest.mark.parametrize("threads", [2, 8])
def test_the_result_does_not_depend_on_the_thread_count(threads: int) -> None:
    """The loop runs at every thread count (docs/amx.md "Threads"); 8 threads on a 2-core machine too."""
    require_loop("the attention loop", "avx512f", "avx512")
    q, k, v = _inputs(2, 4, 2, 90, 70, 64)
    with num_threads(1):
        one = _run(q, k, v, 0.125)
    with num_threads(threads):
        many = _run(q, k, v, 0.125)
    assert torch.equal(one, many)


@pytest.mark.parametrize(("shape", "mask"), [((1, 2, 1, 8, 8, 24), (0, 0, 0, 0, 0)),
                                             ((1, 3, 2, 8, 8, 16), (0, 0, 0, 0, 0)),
                                             ((1, 2, 1, 8, 8, 272), (0, 0, 0, 0, 0)),
                                             ((1, 2, 2, 8, 8, 16), (0, 1, 0, 0, 0)),
                                             ((1, 2, 2, 8, 8, 16), (0, 3, 0, 0, 0))])
def test_the_entry_point_refuses_what_it_does_not_take(shape: tuple[int, ...], mask: tuple[int, ...]) -> None:
    """A head dim not a multiple of 16 or above 256, heads not a multiple of the kv heads, a mask kind without a
    mask or an unknown kind: a ValueError from the C side before any memory is read."""
    require_c_loops()
    q, k, v = _inputs(*shape)
    heads = [(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v, q)]
    with pytest.raises(ValueError, match="bad shape or mask"):
        extension.full_attention_f32(*heads, mask, shape, 0.1)


def test_without_the_loops_nothing_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C loops off the wrapper says False and leaves ``out`` alone: its callers then run torch's SDPA."""
    monkeypatch.setattr(native, "loops", None)
    q, k, v = _inputs(1, 2, 2, 8, 8, 16)
    out = torch.zeros_like(q)
    assert not full_attention_into(out, q, k, v, 0.25)
    assert torch.equal(out, torch.zeros_like(q))

"""The causal attention loop (``fxquant/native/csrc/attention.c``,
:func:`fxquant.native.attention.causal_attention_into`) against softmax(q k^T * scale + causal mask) v computed in
float64 with torch's ops.

Shapes reach the loop's edges: a last block of fewer than 8 query rows, key blocks of 16 cut by the sequence's end,
one token, grouped-query heads, head dims 16 to 256; inputs are strided views (a transposed query, keys and values
cut from a longer cache, a transposed output), and scores that grow along the sequence (each new key block raises
the rows' maximum, so the running sums are rescaled) or reach the hundreds (no overflow). The loop sums in float32
with fused multiply-adds: errors are bounded, not zero (measured at most 3e-6 on unit-scale values).
"""

from __future__ import annotations

import pytest
import torch
from kernel_contract_cases import require_c_loops, require_loop

from fxquant import native
from fxquant.native.attention import causal_attention_into
from fxquant.native.loader import extension
from fxquant.report.latency import num_threads

TOLERANCE = 2e-5  # absolute, on outputs of unit scale


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-2, -1) * scale
    tokens = q.shape[2]
    scores.masked_fill_(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _inputs(batch: int, heads: int, kv_heads: int, tokens: int, dim: int,
            growth: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query as transformers makes it (a transposed view), keys and values the first ``tokens`` of a longer cache;
    ``growth`` scales the keys up along the sequence."""
    q = torch.randn(batch, tokens, heads, dim).transpose(1, 2)
    cache = torch.randn(2, batch, kv_heads, tokens + 5, dim)
    k, v = cache[0, :, :, :tokens], cache[1, :, :, :tokens]
    if growth:
        k = k * (1 + growth * torch.arange(tokens, dtype=torch.float32)).view(1, 1, tokens, 1)
    return q, k, v


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    batch, heads, tokens, dim = q.shape
    out = torch.full((batch, tokens, heads, dim), float("nan"))
    assert causal_attention_into(out.transpose(1, 2), q, k, v, scale)  # the loop ran: it writes and says so
    return out.transpose(1, 2)


@pytest.mark.parametrize("shape", [(1, 9, 3, 512, 64), (2, 4, 4, 37, 32), (1, 8, 2, 100, 128), (1, 2, 1, 1, 16),
                                   (3, 3, 3, 7, 16), (1, 2, 2, 16, 256), (1, 6, 2, 33, 48), (2, 2, 1, 9, 64)])
def test_the_loop_computes_causal_attention(shape: tuple[int, int, int, int, int]) -> None:
    require_loop("the attention loop", "avx512f", "avx512")
    q, k, v = _inputs(*shape)
    scale = shape[-1] ** -0.5
    out = _run(q, k, v, scale)
    assert (out.double() - _reference(q, k, v, scale)).abs().max().item() < TOLERANCE


@pytest.mark.parametrize(("growth", "scale", "tolerance"), [(0.05, 0.125, TOLERANCE), (0.0, 40.0, 2e-4)])
def test_rising_and_huge_scores_stay_exact_to_rounding(growth: float, scale: float, tolerance: float) -> None:
    """Keys that grow along the sequence move each row's maximum at every key block; a scale of 40 puts scores in
    the hundreds, where an unshifted exp overflows float32 and the scores' own float32 rounding moves the outputs
    by up to 5e-5 (torch's float32 SDPA: 2e-4)."""
    require_loop("the attention loop", "avx512f", "avx512")
    q, k, v = _inputs(1, 4, 2, 70, 64, growth=growth)
    out = _run(q, k, v, scale)
    assert torch.isfinite(out).all()
    assert (out.double() - _reference(q, k, v, scale)).abs().max().item() < tolerance


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    require_loop("the attention loop", "avx512f", "avx512")
    q, k, v = _inputs(2, 4, 2, 90, 64)
    with num_threads(1):
        one = _run(q, k, v, 0.125)
    with num_threads(2):
        two = _run(q, k, v, 0.125)
    assert torch.equal(one, two)


@pytest.mark.parametrize("shape", [(1, 2, 1, 8, 24), (1, 3, 2, 8, 16), (1, 2, 1, 8, 272)])
def test_the_entry_point_refuses_shapes_it_does_not_take(shape: tuple[int, int, int, int, int]) -> None:
    """A head dim not a multiple of 16 or above 256, or heads not a multiple of the kv heads: a ValueError from the
    C side before any memory is read (the Python callers check first and never get here)."""
    require_c_loops()
    q, k, v = _inputs(*shape)
    heads = [(t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v, q)]
    with pytest.raises(ValueError, match="bad shape"):
        extension.causal_attention_f32(*heads, (1, shape[1], shape[2], shape[3], shape[4]), 0.1)


def test_without_the_loops_nothing_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the C loops off (``FXQUANT_NATIVE=0``, or no compiler at install) the wrapper says False and leaves
    ``out`` alone: its callers then run transformers' SDPA."""
    monkeypatch.setattr(native, "loops", None)
    q, k, v = _inputs(1, 2, 1, 8, 16)
    out = torch.zeros(1, 2, 8, 16)
    assert not causal_attention_into(out, q, k, v, 0.25)
    assert torch.equal(out, torch.zeros(1, 2, 8, 16))

"""A converted model's SDPA calls (:mod:`fxquant.runtime.attention`): fxquant's loops where they compute what
``F.scaled_dot_product_attention`` would, torch's SDPA, bit for bit, for every other call; the graph walk takes
them for models with INT8 layers on a kernel backend, never on the reference backend.

Where a loop runs, the result is SDPA's to float32 rounding (the loops' own tests bound it against float64); the
spies record that the loop ran, so no case passes by comparing SDPA with itself.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from loop_spies import LoopSpy, spy_on

import fxquant
from fxquant.models import example_inputs
from fxquant.native.attention import full_attention_into
from fxquant.qparams import sqnr_db
from fxquant.runtime import attention

TOLERANCE = 2e-5


def _loops_run_here() -> bool:
    x = torch.randn(1, 1, 2, 16)
    return full_attention_into(torch.empty_like(x), x, x, x, 0.25)


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> dict[str, LoopSpy]:
    return {name: spy_on(monkeypatch, attention, name) for name in ("full_attention_into", "causal_attention_into")}


def _qkv(heads: int = 4, kv_heads: int = 4, q_tokens: int = 19, kv_tokens: int = 19,
         dim: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(2, q_tokens, heads, dim).transpose(1, 2)
    k = torch.randn(2, kv_tokens, kv_heads, dim).transpose(1, 2)
    v = torch.randn(2, kv_tokens, kv_heads, dim).transpose(1, 2)
    return q, k, v


_MASKS = torch.Generator().manual_seed(0)  # made at import: seeded, the same masks in every process
CASES = {
    "plain": ({}, {}),
    "scaled": ({}, {"scale": 0.3}),
    "bool_mask": ({}, {"attn_mask": torch.rand(2, 1, 1, 19, generator=_MASKS) > 0.3}),
    "float_mask_3d": ({}, {"attn_mask": torch.randn(4, 19, 19, generator=_MASKS)}),
    "causal": ({}, {"is_causal": True}),
    "cross": ({"q_tokens": 7, "kv_tokens": 40}, {}),
    "grouped": ({"kv_heads": 2}, {"enable_gqa": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_loops_compute_sdpa(case: str, spies: dict[str, LoopSpy]) -> None:
    if not _loops_run_here():
        pytest.skip("the attention loops do not run here (no AVX-512, FXQUANT_ISA below it, or no C extension)")
    shape, kwargs = CASES[case]
    q, k, v = _qkv(**shape)
    out = attention.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert spies["causal_attention_into" if kwargs.get("is_causal") else "full_attention_into"].ran == 1
    assert out.stride() == q.stride()  # laid out as the query: the (batch, tokens, heads, dim) view is free
    assert (out - expected).abs().max().item() < TOLERANCE


DECLINED = {
    "float64": lambda q, k, v: ((q.double(), k.double(), v.double()), {}),
    "head_dim_24": lambda q, k, v: ((q[..., :24], k[..., :24], v[..., :24]), {}),
    "value_dim_16": lambda q, k, v: ((q, k, v[..., :16].contiguous()), {}),
    "mask_strided_along_keys": lambda q, k, v: ((q, k, v), {"attn_mask": torch.randn(19, 38)[:, ::2]}),
    "causal_and_mask": lambda q, k, v: ((q, k, v), {"attn_mask": torch.randn(19, 19), "is_causal": True}),
    "mask_broadcast_over_keys": lambda q, k, v: ((q, k, v), {"attn_mask": torch.zeros(19, 1)}),
    "autograd": lambda q, k, v: ((q.clone().requires_grad_(), k, v), {}),
}


@pytest.mark.parametrize("case", list(DECLINED))
def test_what_the_loops_do_not_compute_is_torchs_sdpa_bit_for_bit(case: str, spies: dict[str, LoopSpy]) -> None:
    (q, k, v), kwargs = DECLINED[case](*_qkv())
    out = attention.scaled_dot_product_attention(q, k, v, **kwargs)
    assert spies["full_attention_into"].ran == spies["causal_attention_into"].ran == 0
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, **kwargs))


def test_grouped_heads_without_enable_gqa_are_refused_as_sdpa_refuses_them() -> None:
    q, k, v = _qkv(kv_heads=2)
    with pytest.raises(RuntimeError) as expected:
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value).splitlines()[0])):
        attention.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("backend", ["onednn", "reference"])
def test_the_graph_walk_takes_the_loop_only_on_kernel_backends(prepared_bert_style: torch.fx.GraphModule,
                                                               backend: str, spies: dict[str, LoopSpy]) -> None:
    """The converted encoder's 4 SDPA nodes: the loop on onednn, each call SDPA's output on its inputs to rounding,
    and torch's SDPA on the reference backend, the generated code's output bit for bit."""
    qmodel = fxquant.convert(prepared_bert_style, backend=backend)
    x = example_inputs("bert_style", 2)
    calls: list[tuple[torch.Tensor, ...]] = []  # (output, query, key, value) of each call the loop ran
    inner = spies["full_attention_into"].inner

    def recorded(out: torch.Tensor, *args: Any) -> bool:
        ran = inner(out, *args)
        if ran:
            calls.append((out, *args[:3]))
        return ran

    spies["full_attention_into"].inner = recorded
    out = qmodel(*x)
    generated = type(qmodel).forward(qmodel, *x)  # the generated code: torch's SDPA
    loops = _loops_run_here()
    assert spies["full_attention_into"].ran == len(calls) == (4 if backend == "onednn" and loops else 0)
    for result, q, k, v in calls:
        assert (result - F.scaled_dot_product_attention(q, k, v)).abs().max().item() < TOLERANCE
    if backend == "reference" or not loops:
        assert torch.equal(out, generated)
    else:  # each attention output is quantized next: a rounding difference can move a value by one step
        assert sqnr_db(generated, out) > 50.0  # measured: 64 dB to bit-identical across runs and ISA caps

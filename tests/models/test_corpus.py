"""fxquant.models.corpus without a model: the stdlib-docstring texts, token windows and perplexity, on a word-level
tokenizer and hand-made logits whose perplexity is known exactly."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fxquant.errors import InputError
from fxquant.models import corpus


class WordTokenizer:
    """One id per distinct whitespace-separated word, in order of first appearance."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]


def test_the_texts_are_real_disjoint_and_deterministic() -> None:
    calibration, evaluation = corpus.calibration_text(), corpus.evaluation_text()
    assert min(len(calibration.split()), len(evaluation.split())) > 5000
    assert set(corpus.CALIBRATION_MODULES).isdisjoint(corpus.EVALUATION_MODULES)
    shared = set(corpus.paragraphs(calibration)) & set(corpus.paragraphs(evaluation))
    assert not shared, f"{len(shared)} paragraphs in both texts, e.g. {next(iter(shared))!r}"
    assert ">>>" not in calibration + evaluation
    corpus.calibration_text.cache_clear()
    corpus.evaluation_text.cache_clear()
    assert (corpus.calibration_text(), corpus.evaluation_text()) == (calibration, evaluation)


def test_windows_are_consecutive_and_do_not_overlap() -> None:
    tokenizer = WordTokenizer()
    text = corpus.evaluation_text()
    windows = corpus.token_windows(tokenizer, text, 16, 5)
    assert [(w.shape, w.dtype) for w in windows] == [(torch.Size([1, 16]), torch.int64)] * 5
    assert torch.cat(windows, dim=1)[0].tolist() == tokenizer.encode(text)[:80]
    every = corpus.token_windows(WordTokenizer(), "a b c d e f g", 3)
    assert [w[0].tolist() for w in every] == [[0, 1, 2], [3, 4, 5]]  # the partial last window is dropped


@pytest.mark.parametrize(("text", "seq_len", "count", "match"), [
    ("a b c", 4, None, "3 tokens: 0 window"),
    ("a b c d e f g h", 4, 3, "2 window.*asked for 3"),
    ("a b c", 1, None, "at least 2"),
])
def test_too_little_text_is_an_input_error(text: str, seq_len: int, count: int | None, match: str) -> None:
    with pytest.raises(InputError, match=match):
        corpus.token_windows(WordTokenizer(), text, seq_len, count)


def test_uniform_logits_have_the_vocabulary_size_as_perplexity() -> None:
    vocab = 50
    windows = corpus.token_windows(WordTokenizer(), " ".join(str(i) for i in range(40)), 8)

    def uniform(ids: torch.Tensor) -> SimpleNamespace:  # as transformers and fxquant's drop-in models return
        return SimpleNamespace(logits=torch.zeros(*ids.shape, vocab))

    measured = corpus.perplexity(uniform, windows)
    assert math.isclose(measured, vocab, rel_tol=1e-6), measured


def test_a_model_that_predicts_the_next_token_has_perplexity_one() -> None:
    windows = corpus.token_windows(WordTokenizer(), " ".join(str(i) for i in range(12)), 6)

    def oracle(ids: torch.Tensor) -> tuple[torch.Tensor]:  # logits at t pick token t + 1
        logits = torch.full((*ids.shape, 16), -1e4)
        logits[0, torch.arange(ids.shape[1] - 1), ids[0, 1:]] = 0.0
        return (logits,)

    measured = corpus.perplexity(oracle, windows)
    assert math.isclose(measured, 1.0, abs_tol=1e-9), measured


def test_perplexity_refuses_no_windows_and_outputs_without_logits() -> None:
    with pytest.raises(InputError, match="at least one"):
        corpus.perplexity(lambda ids: ids, [])
    with pytest.raises(InputError, match="no logits"):
        corpus.perplexity(lambda ids: {"scores": ids}, [torch.zeros(1, 4, dtype=torch.int64)])

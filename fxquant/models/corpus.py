"""Real English text that ships with every Python, split into disjoint calibration and evaluation parts, cut into
token windows, and the perplexity of a causal language model on them.

The text is the docstrings (``inspect.getdoc``) of standard-library modules and of their public functions and
classes, over two fixed, sorted, disjoint module lists; examples (paragraphs with ``>>>``) are left out, and a
paragraph already in the calibration text (an inherited docstring, say) is left out of the evaluation text. The
text is deterministic for a given Python version (docstrings change between versions), needs no network, and no
package beyond the standard library.

>>> calibration, evaluation = calibration_text(), evaluation_text()
>>> set(paragraphs(calibration)).isdisjoint(paragraphs(evaluation))
True
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from fxquant.errors import InputError

CALIBRATION_MODULES = ("argparse", "collections", "json", "logging", "os", "re", "shutil", "statistics",
                       "subprocess", "tempfile")
EVALUATION_MODULES = ("contextlib", "difflib", "inspect", "itertools", "socket", "textwrap",
                      "xml.etree.ElementTree")


class Tokenizer(Protocol):
    """What :func:`token_windows` needs of a tokenizer: transformers' ``encode`` signature."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def paragraphs(text: str) -> list[str]:
    """The blank-line separated paragraphs of ``text``, stripped, empty ones dropped."""
    return [part.strip() for part in text.split("\n\n") if part.strip()]


def _module_paragraphs(name: str) -> list[str]:
    module = importlib.import_module(name)
    objects = [module] + [obj for key, obj in sorted(vars(module).items())
                          if not key.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                          and getattr(obj, "__module__", None) == module.__name__]
    return [part for obj in objects for part in paragraphs(inspect.getdoc(obj) or "") if ">>>" not in part]


def _text(modules: Iterable[str], exclude: Iterable[str] = ()) -> str:
    seen = set(exclude)
    kept = []
    for name in sorted(modules):
        for part in _module_paragraphs(name):
            if part not in seen:
                seen.add(part)
                kept.append(part)
    return "\n\n".join(kept)


@functools.cache
def calibration_text() -> str:
    """Docstrings of :data:`CALIBRATION_MODULES`: the text to calibrate on."""
    return _text(CALIBRATION_MODULES)


@functools.cache
def evaluation_text() -> str:
    """Docstrings of :data:`EVALUATION_MODULES`, without any paragraph of :func:`calibration_text`: the text to
    measure on."""
    return _text(EVALUATION_MODULES, exclude=paragraphs(calibration_text()))


def token_windows(tokenizer: Tokenizer, text: str, seq_len: int, count: int | None = None) -> list[torch.Tensor]:
    """Consecutive, non-overlapping ``1 x seq_len`` int64 windows of the tokens of ``text`` (no special tokens
    added), from the start: ``count`` of them, or every whole window when ``count`` is None.

    Raises ``InputError`` when the text holds fewer than ``count`` windows (fewer than one when ``count`` is None).
    """
    if seq_len < 2:
        raise InputError(f"seq_len must be at least 2 (a window predicts its next tokens), got {seq_len}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    fits = len(ids) // seq_len
    wanted = 1 if count is None else count
    if wanted < 1 or fits < wanted:
        raise InputError(f"the text has {len(ids)} tokens: {fits} window(s) of {seq_len}, asked for "
                         f"{'at least 1' if count is None else count}. Use a shorter seq_len, fewer windows or "
                         "a longer text")
    tokens = torch.tensor(ids[:seq_len * (fits if count is None else count)], dtype=torch.int64)
    return list(tokens.reshape(-1, 1, seq_len).unbind(0))


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Sequence) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InputError(f"the model returned {type(output).__name__}, which has no logits: perplexity needs a causal "
                     "LM returning a tensor, an output with .logits, or a tuple with the logits first")


def next_token_losses(output: Any, window: torch.Tensor) -> torch.Tensor:
    """The float32 cross entropy of every next-token prediction of ``output`` (the logits, an output with
    ``.logits`` or a tuple with the logits first) for the ``batch x seq_len`` token ids ``window``: position t
    predicts token t + 1, so ``batch x (seq_len - 1)`` values, flattened."""
    logits = _logits(output)
    if logits.shape[:2] != window.shape or logits.dim() != 3:
        raise InputError(f"logits of shape {tuple(logits.shape)} for token ids of shape {tuple(window.shape)}: "
                         "perplexity needs a causal LM returning (batch, seq_len, vocab) logits")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), window[:, 1:].flatten(), reduction="none")


@torch.inference_mode()
def perplexity(model: Callable[..., Any], windows: Sequence[torch.Tensor]) -> float:
    """exp of the mean next-token cross entropy over every position of every window (the logits at position t
    predict token t + 1), accumulated in float64 so rounding does not grow with the number of tokens.

    ``model(window)`` is called positionally and may return the logits, an output with ``.logits`` (transformers,
    and fxquant's INT8 models, which return the user's output classes) or a tuple with the logits first.
    """
    if not windows:
        raise InputError("perplexity needs at least one token window, got none")
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for window in windows:
        losses = next_token_losses(model(window), window)
        total += losses.double().sum()
        count += losses.numel()
    return math.exp(total.item() / count)

"""``--data corpus.txt --seq-len 512``: text for language models, cut into token windows.

The text is a UTF-8 file, or the text column of a Hugging Face dataset (a ``save_to_disk`` folder or a hub name;
``--columns`` names the column, default ``text``; rows are joined by blank lines). It is tokenized whole by the
run's tokenizer (the one saved beside a ``transformers:FOLDER`` model, or ``--tokenizer FOLDER``) without special
tokens, and cut into consecutive, non-overlapping windows of ``--seq-len`` tokens (the tail shorter than a window is
dropped, as :func:`fxquant.models.corpus.token_windows` does); ``--batch-size`` windows make one ``batch x seq_len``
int64 batch of ``input_ids``. For ``fxquant report --metric perplexity`` each batch is ``(input_ids, input_ids)``:
the target of position ``t`` is the token at ``t + 1`` of the same window.

Bad text fails before anything is computed, naming the file and the fix: an empty file, a binary or non-UTF-8 file,
text shorter than one window, a window longer than the model's context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxquant.cli.hf import context_length
from fxquant.errors import InputError

DEFAULT_COLUMN = "text"
_SNIFF = 8192  # bytes looked at for NUL bytes, the mark of a binary file


def read_text_file(path: Path, spec: str) -> str:
    """The UTF-8 text of ``path``; empty, binary and non-UTF-8 files are one clear ``InputError`` each."""
    if not path.is_file():
        raise InputError(f"--data {spec!r}: no such file")
    data = path.read_bytes()
    if b"\0" in data[:_SNIFF]:
        raise InputError(f"--data {spec!r} is a binary file, not text; give a UTF-8 text file (or a .npy/.npz/.pt "
                         "file of token ids without --seq-len)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"--data {spec!r} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                         f"convert it, e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8.txt") from None
    if not text.strip():
        raise InputError(f"--data {spec!r} is empty; give a text file with at least one window of --seq-len tokens")
    return text


def column_text(dataset: Any, column: str, spec: str) -> str:
    """The rows of ``dataset``'s text ``column``, joined by blank lines."""
    names = list(getattr(dataset, "column_names", []) or [])
    if column not in names:
        raise InputError(f"--data {spec!r} has no text column {column!r}; name it with --columns (columns: "
                         f"{', '.join(names) or 'none'})")
    rows = dataset[column]
    if not all(isinstance(row, str) for row in rows):
        raise InputError(f"--data {spec!r}: column {column!r} does not hold text (strings)")
    text = "\n\n".join(row for row in rows if row.strip())
    if not text:
        raise InputError(f"--data {spec!r}: column {column!r} holds no text")
    return text


def token_ids(tokenizer: Any, text: str, seq_len: int, spec: str) -> torch.Tensor:
    """The ``count x seq_len`` int64 windows of ``text``'s tokens (every whole window)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    count = len(ids) // seq_len
    if count < 1:
        raise InputError(f"--data {spec!r} holds {len(ids)} tokens, fewer than one window of --seq-len {seq_len}; "
                         "give more text or a smaller --seq-len")
    return torch.tensor(ids[:count * seq_len], dtype=torch.int64).view(count, seq_len)


def check_seq_len(seq_len: int, model: nn.Module) -> None:
    """A window must fit the model's context (``config.max_position_embeddings``) and predict a next token."""
    if seq_len < 2:
        raise InputError(f"--seq-len {seq_len}: a window needs at least 2 tokens (one predicts the next)")
    limit = context_length(model)
    if limit is not None and seq_len > limit:
        raise InputError(f"--seq-len {seq_len} is longer than the model's context of {limit} tokens "
                         f"(config.max_position_embeddings); pass --seq-len {limit} or less")


def window_batches(windows: torch.Tensor, batch_size: int, targets: bool) -> tuple[Callable[[], Iterator[Any]], int]:
    """A generator factory of ``batch_size``-window batches (``(ids, ids)`` pairs with ``targets``), and how many."""
    starts = range(0, len(windows), batch_size)

    def make() -> Iterator[Any]:
        for start in starts:
            ids = windows[start:start + batch_size]
            yield (ids, ids) if targets else ids

    return make, len(starts)

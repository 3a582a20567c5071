"""``--data SPEC``: turn what a user names on the command line into an iterable of batches.

Accepted, tried in this order:

* an ``.npy`` / ``.npz`` / ``.pt`` file of tensors (``.pt`` loads with ``weights_only``; nothing is unpickled): cut
  into batches of ``--batch-size`` rows. A tensor gives tensors; an ``.npz`` or a tuple/list in a ``.pt`` gives
  tuples of its arrays (e.g. ``(images, labels)``); a dict in a ``.pt`` gives dicts (keyword inputs);
* a directory written by Hugging Face ``datasets`` (``save_to_disk``): read ``--batch-size`` rows at a time as dicts
  of tensors (``--split`` picks the split of a ``DatasetDict``);
* ``PKG.MODULE:FUNCTION``: called with no arguments, it returns any iterable of batches (a DataLoader, a list...);
* otherwise a Hugging Face hub dataset name, loaded with ``datasets.load_dataset`` when the network allows.

With ``--seq-len N`` the data is text instead (:mod:`fxquant.cli.text`): a UTF-8 file, or the text column of a
``save_to_disk`` folder or hub dataset, cut into windows of N tokens by the run's tokenizer.

``--columns a,b`` turns dict batches into the tuple ``(batch["a"], batch["b"])`` (one column: just its value), the
order positional inputs and ``(inputs, target)`` pairs need. ``--transform PKG.MODULE:FUNCTION`` is applied to each
batch first.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fxquant.cli.hf import hub_unresolved
from fxquant.cli.specs import call_object, load_object
from fxquant.cli.text import DEFAULT_COLUMN, column_text, read_text_file, token_ids, window_batches
from fxquant.errors import InputError
from fxquant.serialization import load_tensors

_CODE_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
TENSOR_FILES = (".npy", ".npz", ".pt")
TEXT_FILES = (".txt", ".md", ".rst", ".text")


@dataclass(frozen=True)
class DataOptions:
    """The ``--data`` family of options of one command."""

    spec: str
    batch_size: int = 32
    columns: tuple[str, ...] = ()
    transform: str | None = None
    split: str = "train"
    seq_len: int | None = None  # text: windows of this many tokens (fxquant.cli.text)
    targets: bool = False  # text: batches of (input_ids, input_ids), for a next-token metric


class Batches:
    """A re-iterable sequence of batches with a length (so progress bars know the total)."""

    def __init__(self, make: Callable[[], Iterator[Any]], length: int | None) -> None:
        self._make, self._length = make, length

    def __iter__(self) -> Iterator[Any]:
        return self._make()

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("length unknown")
        return self._length


def _check_columns(available: list[str], columns: tuple[str, ...], where: str) -> None:
    for column in columns:
        if column not in available:
            near = difflib.get_close_matches(column, available, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise InputError(f"--columns: {where} has no column {column!r}.{hint} Columns: {', '.join(available)}")


def _select(batch: Any, columns: tuple[str, ...], where: str) -> Any:
    """The ``columns`` of a dict batch: one column gives its value, several a tuple in that order."""
    if not columns:
        return batch
    if not isinstance(batch, dict):
        raise InputError(f"--columns needs batches with named columns, but {where} yields {type(batch).__name__}")
    _check_columns(list(batch), columns, where)
    return batch[columns[0]] if len(columns) == 1 else tuple(batch[c] for c in columns)


def _finish(source: Iterable[Any], opts: DataOptions, length: int | None) -> Batches:
    """Apply ``--transform`` and ``--columns`` lazily to each batch of ``source``."""
    transform = load_object(opts.transform, "--transform") if opts.transform else None
    if transform is not None and not callable(transform):
        raise InputError(f"--transform {opts.transform!r} is not callable")

    def make() -> Iterator[Any]:
        for batch in source:
            yield _select(transform(batch) if transform else batch, opts.columns, f"--data {opts.spec!r}")

    return Batches(make, length)


def _rows(columns: list[torch.Tensor], opts: DataOptions, wrap: Callable[[tuple[Any, ...]], Any]) -> Batches:
    """Cut equally long ``columns`` into batches of ``--batch-size`` rows; ``wrap`` shapes each batch."""
    rows = {len(c) for c in columns}
    if len(rows) != 1:
        raise InputError(f"--data {opts.spec!r}: arrays have different numbers of rows {sorted(rows)}")
    (count,) = rows
    starts = range(0, count, opts.batch_size)

    def make() -> Iterator[Any]:
        for i in starts:
            yield wrap(tuple(c[i:i + opts.batch_size] for c in columns))

    return Batches(make, len(starts))


def _table(value: Any, opts: DataOptions) -> Batches:
    """Batches of a loaded file: a tensor gives tensors, a tuple/list tuples, a dict dicts (``--columns`` picks)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return _rows([torch.as_tensor(value)], opts, lambda parts: parts[0])
    if isinstance(value, dict) and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value.values()):
        names = list(value)
        tensors = [torch.as_tensor(v) for v in value.values()]
        return _rows(tensors, opts, lambda parts: dict(zip(names, parts, strict=True)))
    if isinstance(value, (tuple, list)) and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in value):
        return _rows([torch.as_tensor(v) for v in value], opts, tuple)
    raise InputError(f"--data {opts.spec!r} holds a {type(value).__name__}; save a tensor, a tuple/list of tensors "
                     "or a dict of tensors")


def _load_file(path: Path, opts: DataOptions) -> Batches:
    if path.suffix == ".pt":
        value: Any = load_tensors(path)
    else:
        try:
            loaded = np.load(path, allow_pickle=False)  # object arrays would need unpickling: refused
        except (ValueError, OSError) as exc:
            raise InputError(f"--data {opts.spec!r}: cannot read {path.suffix} file ({exc})") from None
        if path.suffix == ".npz":  # arrays in file order, e.g. (images, labels), unless --columns says otherwise
            value = {k: loaded[k] for k in loaded.files}
            opts = dataclasses.replace(opts, columns=opts.columns or tuple(loaded.files))
        else:
            value = loaded
    batches = _table(value, opts)
    return _finish(batches, opts, len(batches))


def _hf_batches(dataset: Any, opts: DataOptions) -> Batches:
    dataset = _split(dataset, opts)
    torch_view = dataset.with_format("torch")
    length = -(-len(dataset) // opts.batch_size)
    return _finish(Batches(lambda: iter(torch_view.iter(batch_size=opts.batch_size)), length), opts, length)


def _split(dataset: Any, opts: DataOptions) -> Any:
    """``--split``'s part of a ``DatasetDict``; a ``Dataset`` as it is."""
    if hasattr(dataset, "keys") and not hasattr(dataset, "with_format"):
        if opts.split not in dataset:
            raise InputError(f"--data {opts.spec!r} has no split {opts.split!r}; pass --split with one of "
                             f"{', '.join(dataset.keys())}")
        return dataset[opts.split]
    return dataset


def _from_disk(path: Path, opts: DataOptions) -> Any:
    import datasets  # lazy: importing datasets takes a second

    try:
        return datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise InputError(f"--data {opts.spec!r} is a directory but not a dataset saved with datasets' "
                         f"save_to_disk ({str(exc).splitlines()[0]})") from None


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached, found quickly (datasets itself retries for half a minute)."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").lower() in ("1", "true", "yes", "on"):
            return f"offline mode is set ({variable}=1)"
    return hub_unresolved()


def _load_hub(opts: DataOptions) -> Any:
    """The hub dataset ``opts.spec`` names, ``--split``'s part."""
    fix = (f"on a machine with network, run python -c \"import datasets; datasets.load_dataset('{opts.spec}', "
           f"split='{opts.split}').save_to_disk('DIR')\" and pass --data DIR")
    reason = _hub_unreachable()
    if reason is None:
        import datasets

        try:
            return datasets.load_dataset(opts.spec, split=opts.split)
        except Exception as exc:  # datasets raises many types (connection, not found, config); all mean the same
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    raise InputError(f"--data {opts.spec!r} is not a local file or directory, and loading it as a Hugging Face hub "
                     f"dataset failed: {reason}. Fix: {fix}")


def _load_text(opts: DataOptions, path: Path, tokenizer: Callable[[], Any] | None) -> Batches:
    """``--seq-len``: token windows of a text file or a dataset's text column (:mod:`fxquant.cli.text`)."""
    assert opts.seq_len is not None
    if path.suffix in TENSOR_FILES:
        raise InputError(f"--data {opts.spec!r} holds tensors; --seq-len is for text (a UTF-8 file or a dataset's "
                         "text column): drop --seq-len to feed the tensors as they are")
    if tokenizer is None:
        raise InputError("--seq-len needs a tokenizer: prepare the run from a Hugging Face model folder "
                         "(--model transformers:FOLDER), or pass --tokenizer FOLDER")
    if path.is_dir() or not (path.is_file() or opts.spec.startswith((".", "/", "~")) or path.suffix):
        column = opts.columns[0] if opts.columns else DEFAULT_COLUMN
        dataset = _split(_from_disk(path, opts), opts) if path.is_dir() else _load_hub(opts)
        source = column_text(dataset, column, opts.spec)
    else:
        source = read_text_file(path, opts.spec)
    windows = token_ids(tokenizer(), source, opts.seq_len, opts.spec)
    make, length = window_batches(windows, opts.batch_size, opts.targets)
    return _finish(Batches(make, length), dataclasses.replace(opts, columns=()), length)


def load_data(opts: DataOptions, tokenizer: Callable[[], Any] | None = None) -> Batches:
    """The batches ``opts.spec`` names (see the module docstring for what is accepted, in which order);
    ``tokenizer`` makes the tokenizer that text (``opts.seq_len``) needs, called only for text."""
    path = Path(opts.spec).expanduser()
    if opts.seq_len is not None:
        return _load_text(opts, path, tokenizer)
    if path.suffix in TEXT_FILES:
        raise InputError(f"--data {opts.spec!r} is text: pass --seq-len N to cut it into windows of N tokens")
    if path.suffix in TENSOR_FILES:
        if not path.is_file():
            raise InputError(f"--data {opts.spec!r}: no such file")
        return _load_file(path, opts)
    if path.is_dir():
        return _hf_batches(_from_disk(path, opts), opts)
    if _CODE_REF.match(opts.spec):
        data = call_object(opts.spec, "--data")
        if isinstance(data, (torch.Tensor, np.ndarray)):
            data = [data]  # one batch, not an iterable of rows
        if not isinstance(data, Iterable) and not isinstance(data, torch.Tensor):
            raise InputError(f"--data {opts.spec!r} returned {type(data).__name__}, not an iterable of batches")
        return _finish(data, opts, _length(data))
    if opts.spec.startswith((".", "/", "~")) or path.suffix:
        raise InputError(f"--data {opts.spec!r}: no such file or directory")
    return _hf_batches(_load_hub(opts), opts)


def _length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


"""Turn whatever a user iterates over into ``(args, kwargs)`` for the model's forward.

Accepted batches: a tensor or numpy array (one positional input); a tuple/list (positional inputs; trailing extra
items such as labels are dropped when the model takes fewer inputs); a dict (keyword inputs; keys the model does not
take, such as ``label``, are dropped). A torch DataLoader or any iterable of such batches works as is; a Hugging Face
``datasets.Dataset`` (built in memory, from local csv/json/parquet files, or loaded with ``load_from_disk``) is
iterated in batches of ``batch_size`` rows as a dict of torch tensors (non-numeric columns stay Python lists and are
dropped unless the forward takes them).

A ``transform`` (any callable ``batch -> batch``) is applied to each batch before it is adapted: tokenize raw
text, rename columns to the forward's parameter names, stack a list of samples (a collate function), or pick
``batch["pixel_values"]``. It runs only on the batches that are used (not on those a resumed or sharded run skips).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import fx

from fxquant.errors import InputError

Batch = Any
Transform = Callable[[Any], Any]


def forward_parameters(gm: fx.GraphModule) -> tuple[list[str], int]:
    """The forward's parameter names (in order) and how many of them are required."""
    names, required = [], 0
    for node in gm.graph.find_nodes(op="placeholder"):
        names.append(str(node.target).lstrip("*"))
        required += int(not node.args)  # a placeholder's args hold its default value
    return names, required


def _as_tensor(value: Any) -> Any:
    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def to_call_args(batch: Batch, params: Sequence[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for one batch (see the module docstring for the accepted shapes)."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return (_as_tensor(batch),), {}
    if isinstance(batch, Mapping):
        return (), {k: _as_tensor(v) for k, v in batch.items() if k in params}
    if isinstance(batch, (tuple, list)):
        return tuple(_as_tensor(v) for v in batch[: len(params)]), {}
    raise InputError(
        f"cannot feed a batch of type {type(batch).__name__} to the model; yield tensors, tuples/lists of tensors "
        "or dicts of keyword inputs"
    )


def batch_size_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def iterate_batches(data: Iterable[Batch] | torch.Tensor, *, batch_size: int = 32,
                    transform: Transform | None = None) -> Iterator[Batch]:
    """Batches from ``data``, each passed through ``transform`` when given.

    A bare tensor or array is one batch; a HF ``datasets.Dataset`` is read ``batch_size`` rows at a time. Example::

        for batch in iterate_batches(dataset, batch_size=16, transform=lambda b: {"x": b["image"] / 255}):
            prepared(**batch)
    """
    raw = _raw_batches(data, batch_size)
    return raw if transform is None else map(transform, raw)


def _raw_batches(data: Iterable[Batch] | torch.Tensor, batch_size: int) -> Iterator[Batch]:
    if isinstance(data, (torch.Tensor, np.ndarray)):
        yield data
        return
    if _is_hf_dataset(data):
        yield from cast(Any, data).with_format("torch").iter(batch_size=batch_size)
        return
    if not isinstance(data, Iterable):
        raise InputError(f"calibration data must be iterable (a DataLoader, list of batches, ...), "
                         f"got {type(data).__name__}")
    yield from data


def count_batches(data: object, batch_size: int = 32) -> int | None:
    """How many batches :func:`iterate_batches` will yield, when ``data`` knows its length (for progress bars)."""
    if isinstance(data, (torch.Tensor, np.ndarray)):
        return 1
    try:
        length = len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
    return -(-length // batch_size) if _is_hf_dataset(data) else length


def _is_hf_dataset(data: object) -> bool:
    return type(data).__module__.startswith("datasets.") and hasattr(data, "with_format")

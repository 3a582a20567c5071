"""Turn whatever a user iterates over into ``(args, kwargs)`` for the model's forward.

Accepted batches: a tensor or numpy array (one positional input); a tuple/list (positional inputs; trailing extra
items such as labels are dropped when the model takes fewer inputs); a dict (keyword inputs; keys the model does not
take, such as ``label``, are dropped). A torch DataLoader or any iterable of such batches works as is; a Hugging Face
``datasets.Dataset`` is iterated in batches of ``batch_size`` rows as torch tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import fx

from fxquant.errors import InputError

Batch = Any


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


def iterate_batches(data: Iterable[Batch] | torch.Tensor, *, batch_size: int = 32) -> Iterator[Batch]:
    """Batches from ``data``; a bare tensor is one batch, a HF ``datasets.Dataset`` is read in batches."""
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


def _is_hf_dataset(data: object) -> bool:
    return type(data).__module__.startswith("datasets.") and hasattr(data, "with_format")

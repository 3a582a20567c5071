"""The weights column of ``bench_llm.py``: the bytes of every distinct tensor storage reachable from a model.

Parameters, buffers, the state dict (which holds torch.ao's packed weights) and module attributes (which hold
fxquant's packed ones) are walked; a storage shared by two tensors (a tied embedding) counts once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _tensors(obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    """The tensors reachable from ``obj`` through modules (state dict and attributes), dataclasses and containers."""
    if isinstance(obj, torch.Tensor):  # a tensor subclass (torchao's): its inner tensors hold the bytes
        inner = obj.__tensor_flatten__()[0] if hasattr(obj, "__tensor_flatten__") else None
        yield from (t for name in inner for t in _tensors(getattr(obj, name), seen)) if inner is not None else (obj,)
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        children = [*obj.state_dict(keep_vars=True).values(),
                    *(value for module in obj.modules() for key, value in vars(module).items() if key != "_modules")]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        children = list(obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ())
    for child in children:
        yield from _tensors(child, seen)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    try:
        return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
    except NotImplementedError:  # an opaque tensor (oneDNN's packed layout) shows no storage: its elements' bytes
        return id(tensor), tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module) -> int:
    return sum(dict(_storage(tensor) for tensor in _tensors(model, set())).values())

"""The weights column of ``bench_llm.py``: the bytes of every distinct tensor storage reachable from a model, plus
the reordered weights fxquant's oneDNN primitives allocate themselves.

Parameters, buffers, the state dict (which holds torch.ao's packed weights) and module attributes (which hold
fxquant's packed ones) are walked; a storage shared by two tensors (a tied embedding) counts once, and so does a
primitive's reordered copy (``weights_bytes``, by its ``weights_address``; a primitive using another's counts 0).
A state-dict tensor made anew on each call (an int8 weight read back from the primitives that hold it) is not
resident and is not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _tensors(obj: Any, seen: set[int]) -> Iterator[Any]:
    """The tensors reachable from ``obj`` through modules (state dict and attributes), dataclasses and containers,
    and the oneDNN primitives (objects with ``weights_bytes``)."""
    if hasattr(obj, "weights_bytes") and hasattr(obj, "weights_address"):
        yield obj
        return
    if isinstance(obj, torch.Tensor):  # a tensor subclass (torchao's): its inner tensors hold the bytes
        inner = obj.__tensor_flatten__()[0] if hasattr(obj, "__tensor_flatten__") else None
        yield from (t for name in inner for t in _tensors(getattr(obj, name), seen)) if inner is not None else (obj,)
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        children = [*_resident_state(obj),
                    *(value for module in obj.modules() for key, value in vars(module).items() if key != "_modules")]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        children = list(obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ())
    for child in children:
        yield from _tensors(child, seen)


def _resident_state(module: nn.Module) -> list[Any]:
    """The state dict's values that ``state_dict()`` does not make anew: two calls, both alive, give them the same
    storage (tensors made on each call cannot share an address while both exist)."""
    first, second = module.state_dict(keep_vars=True), module.state_dict(keep_vars=True)
    return [value for key, value in first.items() if _same_tensor(value, second[key])]


def _same_tensor(a: Any, b: Any) -> bool:
    """The same object, or tensors on the same storage (torch.ao's packed weights unpack to new tensors on theirs)."""
    if a is b or not isinstance(a, torch.Tensor):
        return True
    try:
        return bool(_storage(a)[0] == _storage(b)[0])
    except RuntimeError:  # a wrapper subclass (torchao's) made anew: no storage of its own
        return False


def _storage(tensor: Any) -> tuple[int, int]:
    if not isinstance(tensor, torch.Tensor):  # a primitive: its own reordered weights, where they are
        return tensor.weights_address, tensor.weights_bytes
    try:
        return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
    except NotImplementedError:  # an opaque tensor (oneDNN's packed layout) shows no storage: its elements' bytes
        return id(tensor), tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module) -> int:
    sizes: dict[int, int] = {}
    for item in _tensors(model, set()):
        address, size = _storage(item)
        sizes[address] = max(size, sizes.get(address, 0))  # a primitive using another's weights says 0 bytes there
    return sum(sizes.values())

"""What fxquant records about a GraphModule it produced, in ``gm.meta`` (which ``copy.deepcopy`` preserves)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from fxquant.config import QuantConfig
from fxquant.errors import InputError
from fxquant.tracing import GraphBreak

NONE = "none"  # InputSpec.dtype of a positional None
STATE_KEY = "fxquant_state"  # key in GraphModule.meta, which deepcopy preserves
WRAPPED = "model"  # the attribute under which a GraphModule keeps an untraceable root (QuantState.wrapped)
GRAPH_KEY = "_fxquant_graph"  # in a drop-in model's __dict__: the GraphModule fxquant keeps its state on


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of one example input: enough to re-trace the model without the original tensors. A ``None``
    passed in a position (``model(features, None, ids)``) is kept as dtype ``"none"``, so later inputs keep theirs."""

    shape: tuple[int, ...]
    dtype: str

    def make(self) -> torch.Tensor | None:
        if self.dtype == NONE:
            return None
        dtype = getattr(torch, self.dtype)
        return torch.zeros(self.shape, dtype=dtype) if not dtype.is_floating_point else torch.randn(self.shape,
                                                                                                       dtype=dtype)


@dataclass(frozen=True)
class QuantState:
    """What fxquant knows about a GraphModule it produced (kept in ``gm.meta[STATE_KEY]``).

    A converted model carries the observer statistics it was converted from: with the float model they are all that
    is needed to rebuild it (``fxquant.save``/``load``), and to re-lower it to another backend.
    """

    config: QuantConfig
    stage: str  # "prepared" or "converted"
    example_inputs: tuple[InputSpec, ...]
    backend: str | None = None
    observer_state: dict[str, torch.Tensor] = field(default_factory=dict)
    calibration_samples: int = 0
    graph_breaks: tuple[GraphBreak, ...] = ()
    wrapped: bool = False  # the root forward could not be traced: the model runs as one leaf named "model"
    prefix: str = ""  # for an island graph inside an untraceable block: its path in the user's model, plus "."
    layer_backends: dict[str, str] = field(default_factory=dict)  # backend="auto": the backend each layer got
    keep_float: tuple[str, ...] = ()  # converted: convert(keep_float=...) patterns, replayed by fxquant.load
    schemes: dict[str, str] = field(default_factory=dict)  # converted: convert(schemes=...), replayed likewise
    # smoothquant_alpha="auto": each smoothed group's alpha by its first layer's path, replayed by convert (a
    # converted model keeps these, not the sampled rows they were chosen on)
    smoothquant_alphas: dict[str, float | None] = field(default_factory=dict)
    channels_last: bool = False  # calibrate with channels-last Conv2d weights (calibration.memory_format)


def graph_of(model: nn.Module) -> fx.GraphModule:
    """The GraphModule fxquant keeps its state on: ``model`` itself, or, for a drop-in model (a converted model
    whose root does not trace, returned as the user's own class), the GraphModule that wraps it."""
    graph = model.__dict__.get(GRAPH_KEY, model)
    if not isinstance(graph, fx.GraphModule):
        raise InputError(f"{type(model).__name__} was not produced by fxquant; prepare the float model first")
    return graph


def drop_in(gm: nn.Module) -> nn.Module:
    """What ``convert`` hands the user: ``gm`` where its root traced; where it did not, the user's own module inside
    it (same class, ``config``, ``generate()``, outputs, state_dict keys), linked back to ``gm`` (not as a submodule:
    its state_dict and children stay the user's) so that every fxquant function accepts it."""
    if not quant_state(gm).wrapped:
        return gm
    model = gm.get_submodule(WRAPPED)
    _link(model, gm)
    return model


def _link(model: nn.Module, gm: nn.Module) -> None:
    model.__dict__[GRAPH_KEY] = gm
    model.__dict__["__deepcopy__"] = functools.partial(_deepcopy_drop_in, model)  # copy.deepcopy looks it up here


def _deepcopy_drop_in(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of a drop-in model: the model and ``gm`` hold each other, and a GraphModule copied while
    the model's copy is still empty cannot be built. So the model is copied without the link, as ``gm``'s
    submodule (or on its own when the copy started at ``gm``), and the copies are linked after."""
    gm = model.__dict__.pop(GRAPH_KEY)
    hook = model.__dict__.pop("__deepcopy__")
    try:
        if id(gm) in memo:  # copy.deepcopy(gm): its copy is being built around this one
            new, new_gm = copy.deepcopy(model, memo), memo[id(gm)]
        else:
            new_gm = copy.deepcopy(gm, memo)
            new = new_gm.get_submodule(WRAPPED)
    finally:
        model.__dict__[GRAPH_KEY], model.__dict__["__deepcopy__"] = gm, hook
    _link(new, new_gm)
    return new


def quant_state(gm: nn.Module) -> QuantState:
    """The recorded state of ``gm`` (or of the GraphModule behind a drop-in model); ``InputError`` if fxquant did
    not produce it."""
    state = getattr(gm.__dict__.get(GRAPH_KEY, gm), "meta", {}).get(STATE_KEY)
    if not isinstance(state, QuantState):
        raise InputError(f"{type(gm).__name__} was not produced by fxquant.prepare(); prepare the float model first")
    return state


def update_state(gm: nn.Module, **changes: object) -> None:
    """Replace fields of ``gm``'s recorded state."""
    meta: dict[str, object] = graph_of(gm).meta
    meta[STATE_KEY] = replace(quant_state(gm), **changes)  # type: ignore[arg-type]

"""What fxquant records about a GraphModule it produced, in ``gm.meta`` (which ``copy.deepcopy`` preserves)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from fxquant.config import QuantConfig
from fxquant.errors import InputError
from fxquant.tracing import GraphBreak

STATE_KEY = "fxquant_state"  # key in GraphModule.meta, which deepcopy preserves


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of one example input: enough to re-trace the model without the original tensors."""

    shape: tuple[int, ...]
    dtype: str

    def make(self) -> torch.Tensor:
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
    channels_last: bool = False  # calibrate with channels-last Conv2d weights (calibration.memory_format)


def quant_state(gm: nn.Module) -> QuantState:
    """The recorded state of ``gm``; ``InputError`` if fxquant did not produce it."""
    state = getattr(gm, "meta", {}).get(STATE_KEY)
    if not isinstance(state, QuantState):
        raise InputError(f"{type(gm).__name__} was not produced by fxquant.prepare(); prepare the float model first")
    return state


def update_state(gm: nn.Module, **changes: object) -> None:
    """Replace fields of ``gm``'s recorded state."""
    meta: dict[str, object] = gm.meta  # type: ignore[assignment]  # fx.GraphModule.meta is a plain dict
    meta[STATE_KEY] = replace(quant_state(gm), **changes)  # type: ignore[arg-type]

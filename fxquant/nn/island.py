"""An INT8 island keeps what the user's code reads from the module it replaced.

Where a model's own code runs around INT8 islands (its forward does not trace), that code may read attributes of
the layers it calls: ViT casts its input to ``patch_embeddings.projection.weight.dtype``, Whisper reads its convs'
``stride``. An :class:`Island` answers those reads: the replaced module's plain attributes (``stride``,
``in_features``, ``num_channels``, a ``config`` object ...) as they were, and, for an island of one layer, ``weight``
and ``bias`` as float tensors, made on access (dequantized once the layer is INT8, in the replaced module's layout),
so no float copy is kept. Anything else raises an ``AttributeError`` that names the island and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxquant.nn.layers import layer_kind
from fxquant.nn.quantized import _QuantizedWeighted

SURFACE_KEY = "fxquant_surface"  # in GraphModule.meta, which deepcopy preserves


@dataclass(frozen=True)
class Surface:
    """What an island answers for the module it replaced."""

    path: str  # the island's path in the user's model, for messages
    attributes: dict[str, Any] = field(default_factory=dict)  # plain attributes, by reference
    layer: str | None = None  # for an island of one layer: its name inside the island
    transposed: bool = False  # the replaced layer stored its weight (in, out) (transformers' Conv1D)
    kind: str | None = None  # the replaced module's layer kind (nn.layers.layer_kind), if it was a layer


def surface_of(module: nn.Module, path: str, *, layer: str | None = None, transposed: bool = False) -> Surface:
    """The attributes of ``module`` an island at ``path`` keeps: every public instance attribute that is not a
    module, parameter or buffer (those are the graph's business, or float copies not worth keeping), by reference."""
    attributes = {name: value for name, value in vars(module).items()
                  if not (name.startswith("_") or name == "training" or isinstance(value, nn.Module | torch.Tensor))}
    return Surface(path, attributes, layer, transposed, layer_kind(module))


def _float_weight(layer: nn.Module, name: str) -> Any:
    inner = getattr(layer, "inner", layer)  # a Fused layer keeps its Linear/Conv as ``inner``
    if name == "weight" and isinstance(inner, _QuantizedWeighted):
        return inner.dequantized_weight()
    value = getattr(inner, name)
    return value.detach().float() if isinstance(value, torch.Tensor) and not value.is_floating_point() else value


class Island(fx.GraphModule):
    """A prepared or converted GraphModule standing where the user's module was (see the module doc)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            surface = self.__dict__.get("meta", {}).get(SURFACE_KEY)
            if not isinstance(surface, Surface):
                raise
            if name in surface.attributes:
                return surface.attributes[name]
            if surface.layer is not None and name in ("weight", "bias"):
                value = _float_weight(self.get_submodule(surface.layer), name)
                return value.t() if surface.transposed and name == "weight" and value is not None else value
            kept = ", ".join(sorted(surface.attributes)) or "none"
            raise AttributeError(
                f"{surface.path!r} runs as an fxquant INT8 island, which keeps the attributes {kept}"
                f"{' and a float weight and bias' if surface.layer else ''}, not {name!r}; to keep the module as "
                f"written, pass QuantConfig(exclude=[{surface.path!r}])") from None


def as_island(gm: fx.GraphModule, surface: Surface) -> Island:
    """``gm`` as an :class:`Island` answering for ``surface``'s module (same submodules, graph and meta)."""
    island = Island(gm, gm.graph, type(gm).__name__)
    island.meta = dict(gm.meta)
    island.meta[SURFACE_KEY] = surface
    return island

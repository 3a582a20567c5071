"""What the accuracy-budget search may move to the fallback, ranked: the INT8 layers the fallback changes, one by one
or by kind, most sensitive first (lowest isolated SQNR, :mod:`fxquant.tuning.sensitivity`).

A float fallback applies to every INT8 layer; a scheme fallback (``"weight_only"``, ``"dynamic"``) only to the
Linears that do not run that scheme already (the schemes are Linear-only, see :mod:`fxquant.passes.schemes`).

``granularity="kind"`` groups the layers that are the same layer of repeated blocks: their paths are equal once each
numeric part (a block's index) is a ``*`` (``model.layers.*.mlp.down_proj``), which is the fnmatch pattern that
names them all in ``convert(keep_float=...)`` and ``convert(schemes=...)``. An LLM of 30 blocks then has 8
candidates instead of 211, few enough for a trial budget of a dozen conversions, and the recipe found reads like a
hand-written one. A kind's SQNR is that of its members' mean noise-to-signal ratio: kinds whose layers add the most
error in total rank first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from torch import fx, nn

from fxquant.state import graph_of
from fxquant.tuning.sensitivity import int8_layers, layer_sqnr

GRANULARITIES = ("layer", "kind")


def layer_kind(path: str) -> str:
    """``path`` with each numeric part as ``*``: the pattern naming this layer in every repeated block."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _kind_sqnr(values: list[float]) -> float:
    noise = sum(10 ** (-db / 10) for db in values) / len(values)
    return math.inf if noise == 0 else -10 * math.log10(noise)


def _by_kind(sensitivity: dict[str, float]) -> dict[str, float]:
    members: dict[str, list[float]] = {}
    for path, db in sensitivity.items():
        members.setdefault(layer_kind(path), []).append(db)
    return {kind: _kind_sqnr(values) for kind, values in members.items()}


def candidates(prepared: fx.GraphModule, base: nn.Module, batches: Iterable[Any], fallback: str,
               granularity: str) -> dict[str, float]:
    """Layer paths (or kind patterns) that ``fallback`` changes in ``base`` (converted from ``prepared``) -> their
    isolated SQNR in dB, lowest first."""
    graph = graph_of(base)  # the module paths are the GraphModule's (behind a drop-in model)
    layers = int8_layers(prepared, graph)
    sensitivity = {path: db for path, db in layer_sqnr(prepared, graph, batches).items()
                   if fallback == "float" or (layers[path].linear and layers[path].scheme != fallback)}
    ranked = _by_kind(sensitivity) if granularity == "kind" else sensitivity
    return dict(sorted(ranked.items(), key=lambda item: item[1]))

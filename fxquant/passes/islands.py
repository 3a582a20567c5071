"""INT8 islands inside untraceable blocks: what partial tracing cannot put in the main graph, it quantizes alone.

When torch.fx cannot trace a block (data-dependent ``if``, unsupported Python), the block stays a float leaf of the
main graph; its children are traced one by one, and each one that traces becomes a prepared GraphModule of its own
(quantize at its input, dequantize at its output). A child that does not trace either is descended into, down to
single Linear/Conv layers, so every layer torch.fx can reach is quantized.

Sibling islands often read one value (BERT's query, key and value Linears all read ``hidden_states``): after
lowering, the input quantizes of siblings with equal qparams become one
:class:`~fxquant.nn.shared_quantize.SharedQuantize`, which quantizes a value once per call of their parent block and
hands the same int8 tensor to the other readers.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import replace
from typing import Any

from torch import fx, nn

from fxquant.config import QuantConfig
from fxquant.errors import TraceError
from fxquant.kernels.base import Backend
from fxquant.nn.fused import is_plain_layer
from fxquant.nn.island import as_island, surface_of
from fxquant.nn.layers import as_linear, holds_quantizable, is_transposed_linear
from fxquant.nn.quantized import Quantize
from fxquant.nn.shared_quantize import SharedQuantize
from fxquant.passes._graph import replace_submodule
from fxquant.passes.lower import lower_to_int8
from fxquant.passes.pipeline import prepare_graph
from fxquant.state import STATE_KEY, WRAPPED, QuantState, quant_state
from fxquant.tracing import GraphBreak, trace_partially


def _single_layer_graph(name: str, layer: nn.Module) -> fx.GraphModule:
    """``x -> layer(x)`` with the layer called as ``name``: a traced graph of one leaf, keeping its real path."""
    graph = fx.Graph()
    graph.output(graph.call_module(name, (graph.placeholder("x"),)))
    holder = nn.Module()
    holder.add_module(name, layer)
    return fx.GraphModule(holder, graph, type(layer).__name__)


def _prepare_child(parent: nn.Module, name: str, path: str, config: QuantConfig, found: list[GraphBreak]) -> None:
    """Make ``parent.<name>`` an island if it traces, else descend; untraceable forwards are added to ``found``."""
    child = parent.get_submodule(name)
    if not holds_quantizable(child) or not config.settings_for(path, type(child).__name__).quantize:
        return  # nothing to quantize, or excluded by the config: the module stays exactly as the user wrote it
    breaks: tuple[GraphBreak, ...] = ()
    if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # containers have no forward: look inside
        for item in dict(child.named_children()):
            _prepare_child(child, item, f"{path}.{item}", config, found)
        return
    layer = as_linear(child) if is_transposed_linear(child) else child
    single = is_plain_layer(layer)  # one layer: a graph of one call, keeping the layer's own name
    if single:
        gm, prefix = _single_layer_graph(name, layer), path.removesuffix(name)
    else:
        try:
            gm, breaks = trace_partially(child, leaf_modules=config.leaf_modules)
        except TraceError as error:
            if error.failure is not None:
                found.append(replace(error.failure, path=path))
            for grandchild in dict(child.named_children()):
                _prepare_child(child, grandchild, f"{path}.{grandchild}", config, found)
            return
        prefix = f"{path}."
    gm = prepare_graph(gm, config, prefix=prefix)
    gm = as_island(gm, surface_of(child, path, layer=name if single else None, transposed=layer is not child))
    gm.meta[STATE_KEY] = QuantState(config, "prepared", (), graph_breaks=breaks, prefix=prefix)
    found += prepare_islands(gm, breaks, config, prefix=prefix)
    setattr(parent, name, gm)


def prepare_islands(gm: fx.GraphModule, breaks: tuple[GraphBreak, ...], config: QuantConfig,
                    prefix: str = "") -> list[GraphBreak]:
    """Quantize inside every untraceable block of ``gm`` (in place), as far down as torch.fx can trace.

    Returns the further breaks met on the way down (blocks whose own forward does not trace), with full paths.
    """
    found: list[GraphBreak] = []
    for graph_break in breaks:
        block = gm.get_submodule(graph_break.path)
        for name in dict(block.named_children()):
            _prepare_child(block, name, f"{prefix}{graph_break.path}.{name}", config, found)
    return found


def wrap_untraceable_root(model: nn.Module, config: QuantConfig) -> tuple[fx.GraphModule, list[GraphBreak]]:
    """A GraphModule that calls ``model`` as one float leaf, with INT8 islands prepared inside it.

    Used when the root's own ``forward`` cannot be traced (a Hugging Face ``BertModel``'s mask preprocessing, say):
    the forward runs as written, and every child that traces (down to single Linear layers) is quantized.
    """
    graph = fx.Graph()
    parameters = inspect.signature(model.forward).parameters.values()
    kwargs: dict[str, Any] = {p.name: graph.placeholder(p.name, default_value=p.default) for p in parameters
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    graph.output(graph.call_module(WRAPPED, (), kwargs))
    holder = nn.Module()
    holder.add_module(WRAPPED, model)
    gm = fx.GraphModule(holder, graph, type(model).__name__)
    found: list[GraphBreak] = []
    for name in dict(model.named_children()):
        _prepare_child(model, name, name, config, found)
    return gm, found


def prepared_islands(gm: nn.Module) -> dict[str, fx.GraphModule]:
    """Path -> prepared island GraphModule, deepest first (so lowering can go bottom-up)."""
    found = {path: m for path, m in gm.named_modules() if path and isinstance(m, fx.GraphModule)
             and isinstance(m.meta.get(STATE_KEY), QuantState) and quant_state(m).stage == "prepared"}
    return dict(sorted(found.items(), key=lambda item: -item[0].count(".")))


def lower_islands(gm: fx.GraphModule, backend: Backend) -> None:
    """Lower every prepared island inside ``gm`` (in place) to INT8 on ``backend``, then share the input quantizes
    of sibling islands (see the module doc)."""
    for path, island in prepared_islands(gm).items():
        lowered = lower_to_int8(island, quant_state(island).config, backend)
        lowered.meta[STATE_KEY] = replace(quant_state(island), stage="converted", backend=backend.name)
        replace_submodule(gm, path, lowered)
    _share_input_quantizes(gm)


def _share_input_quantizes(gm: fx.GraphModule) -> None:
    """Give sibling islands (same parent block) whose placeholders are quantized with equal qparams one
    :class:`SharedQuantize`, reset by a forward pre-hook on the parent."""
    groups: dict[tuple[Any, ...], list[tuple[fx.GraphModule, str, Quantize]]] = defaultdict(list)
    for path, island in gm.named_modules():
        if island is gm or not isinstance(island, fx.GraphModule) or STATE_KEY not in island.meta:
            continue
        for placeholder in island.graph.find_nodes(op="placeholder"):
            for user in placeholder.users:
                quantize = island.get_submodule(str(user.target)) if user.op == "call_module" else None
                if type(quantize) is Quantize:
                    key = (path.rpartition(".")[0], *quantize.qp.scalar(), quantize.qp.qmin, quantize.qp.qmax)
                    groups[key].append((island, str(user.target), quantize))
    for (parent, *_), members in groups.items():
        if len(members) < 2:
            continue
        shared = SharedQuantize(members[0][2].qp, members[0][2].backend)
        for island, name, _quantize in members:
            replace_submodule(island, name, shared)
        gm.get_submodule(parent).register_forward_pre_hook(shared.reset)

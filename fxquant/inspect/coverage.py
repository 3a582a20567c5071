"""``fxquant.coverage``: every weight-bearing layer of a prepared or converted model, quantized or not, and why not.

Rows: every module whose weight feeds a matmul or convolution (Linear, the convolutions and their subclasses,
transformers' ``Conv1D``, ``nn.MultiheadAttention``) and every lookup table (``nn.Embedding``: float, no
multiply-adds; one tied to an INT8 head reads that head's int8 rows). With the example inputs (the ones given to
``prepare``, unless others are passed) each row also carries its multiply-adds, and the summary gives the fraction
of them that runs INT8.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from fxquant.calibration.observing import observers_kept
from fxquant.inspect.macs import model_macs
from fxquant.nn.fused import COMPUTE_TYPES, Fused
from fxquant.nn.island import SURFACE_KEY, Surface
from fxquant.nn.layers import LOOKUP_TYPES, layer_kind
from fxquant.nn.quantized import DeQuantize, Quantize, _QuantizedWeighted
from fxquant.nn.schemes import SchemeLinear
from fxquant.nn.shared_quantize import SharedQuantize
from fxquant.nn.tied_embedding import TiedInt8Embedding
from fxquant.observers import Observer
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.state import STATE_KEY, WRAPPED, QuantState, graph_of, quant_state


@dataclass(frozen=True)
class LayerCoverage:
    """One layer: its path, float class, whether it runs INT8, why not (for an INT8 layer: a note such as
    "float output"), on which backend, its multiply-adds for the example inputs (0: a lookup, or not run), and, for
    an INT8 layer, its scheme (``QuantConfig.scheme``: a weight-only layer's multiply-adds are float ones)."""

    path: str
    kind: str
    quantized: bool
    reason: str = ""
    backend: str = ""
    macs: int = 0
    scheme: str = ""

    @property
    def int8_macs(self) -> bool:
        """Whether its multiply-adds run on int8 operands (static and dynamic W8A8, not weight-only)."""
        return self.quantized and self.scheme != "weight_only"

    @property
    def lookup(self) -> bool:
        return self.kind in _LOOKUPS


@dataclass(frozen=True)
class Coverage:
    """The coverage table plus the float/int8 boundary counts (quantize and dequantize nodes)."""

    layers: tuple[LayerCoverage, ...]
    quantize_nodes: int
    dequantize_nodes: int
    graph_breaks: tuple[str, ...]

    @property
    def quantized_fraction(self) -> float:
        """INT8 layers over all matmul/conv layers (lookups are not counted)."""
        layers = [layer for layer in self.layers if not layer.lookup]
        return sum(layer.quantized for layer in layers) / max(len(layers), 1)

    @property
    def int8_mac_fraction(self) -> float | None:
        """The fraction of the example inputs' multiply-adds that runs on int8 operands (weight-only layers hold int8
        weights but multiply in float), or None where none were counted."""
        total = sum(layer.macs for layer in self.layers)
        return sum(layer.macs for layer in self.layers if layer.int8_macs) / total if total else None

    def rows(self) -> list[dict[str, object]]:
        return [asdict(layer) for layer in self.layers]

    def __str__(self) -> str:
        header = ("module", "kind", "quantized", "backend", "multiply-adds", "reason")
        rows = [header] + [(r.path, r.kind, _quantized(r), r.backend, _count(r.macs), r.reason) for r in self.layers]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        layers = [layer for layer in self.layers if not layer.lookup]
        done = sum(layer.quantized for layer in layers)
        macs = self.int8_mac_fraction
        share = "" if macs is None else f" ({100 * macs:.1f}% of the multiply-adds at the example inputs on int8)"
        weight_only = sum(layer.scheme == "weight_only" for layer in layers)
        note = f", {weight_only} of them weight-only (int8 weights, float multiply-adds)" if weight_only else ""
        lines.append(f"{done}/{len(layers)} Linear/Conv layers INT8{note}{share}; {self.quantize_nodes} quantize and "
                     f"{self.dequantize_nodes} dequantize nodes")
        lines += [f"graph break: {b}" for b in self.graph_breaks]
        return "\n".join(lines)


def _quantized(row: LayerCoverage) -> str:
    if not row.quantized:
        return "no"
    return "yes" if row.scheme in ("", "static") else f"yes ({row.scheme})"


def _count(macs: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if macs >= size:
            return f"{macs / size:.1f}{unit}"
    return str(macs) if macs else "-"


_LOOKUPS = frozenset(t.__name__ for t in LOOKUP_TYPES)
log = logging.getLogger(__name__)


def _graphs(gm: fx.GraphModule) -> list[tuple[fx.GraphModule, str, QuantState]]:
    """The main graph and every island graph inside untraceable blocks, each with its path prefix."""
    found = [(gm, "", quant_state(gm))]
    for module in gm.modules():
        if isinstance(module, fx.GraphModule) and module is not gm:
            state = module.meta.get(STATE_KEY)
            if isinstance(state, QuantState):
                found.append((module, state.prefix, state))
    return found


def _row(gm: fx.GraphModule, node: fx.Node, path: str, state: QuantState) -> LayerCoverage | None:
    module = gm.get_submodule(str(node.target))
    inner = module.inner if isinstance(module, Fused) else module
    if not isinstance(inner, (*COMPUTE_TYPES, _QuantizedWeighted, SchemeLinear)):
        return None
    if isinstance(inner, SchemeLinear):
        return LayerCoverage(path, "Linear", True, backend=inner.kernel, scheme=inner.scheme)
    kind = type(inner).__name__.removeprefix("Quantized")
    if isinstance(inner, _QuantizedWeighted):
        note = "float output (from the int32 accumulator)" if getattr(inner, "float_output", False) else ""
        return LayerCoverage(path, kind, True, note, backend=inner.backend.name, scheme="static")
    observer = next(iter(node.users)) if len(node.users) == 1 else None
    if observer is not None and isinstance(gm.get_submodule(str(observer.target)) if observer.op == "call_module"
                                           else None, Observer):
        return LayerCoverage(path, kind, True, backend=state.config.backend, scheme="static")
    settings = node.meta.get(LAYER_SETTINGS)
    if settings is not None and not settings.quantize and settings.scheme != "static":  # prepared; no observers
        return LayerCoverage(path, kind, True, scheme=settings.scheme)
    reason = str(settings.reason) if settings is not None and not settings.quantize else \
        "its input is not a tensor produced in the graph (unsupported pattern)"
    return LayerCoverage(path, kind, False, reason)


def _as_replaced_layer(graph: fx.GraphModule, rows: list[tuple[nn.Module, LayerCoverage]]
                       ) -> list[tuple[nn.Module, LayerCoverage]]:
    """An island that replaced one layer (a Linear subclass with its own forward, traced) computes it with one
    module of its own: report that row at the layer's path, as the user knows it."""
    surface = graph.meta.get(SURFACE_KEY)
    if isinstance(surface, Surface) and surface.kind is not None and len(rows) == 1:
        module, row = rows[0]
        return [(module, replace(row, path=surface.path))]
    return rows


def _computed_by_a_child(path: str, seen: set[str]) -> bool:
    """A layer subclass traced through (its ``F.conv2d`` became a module under it) is reported by that child."""
    return any(other.startswith(f"{path}.") for other in seen)


def _unreached(gm: fx.GraphModule, seen: set[str], breaks: dict[str, str]) -> list[tuple[nn.Module, LayerCoverage]]:
    """Layers no graph calls: inside an untraceable block or a leaf, lookups, or used in an unsupported way."""
    rows: list[tuple[nn.Module, LayerCoverage]] = []
    wrapped = quant_state(gm).wrapped
    for full_path, module in gm.named_modules():
        path = full_path.removeprefix(f"{WRAPPED}.") if wrapped else full_path
        parent = gm.get_submodule(full_path.rpartition(".")[0])
        if isinstance(module, SchemeLinear) and path not in seen and not isinstance(parent, Fused):
            # a dynamic or weight-only Linear standing bare where the user's module had its Linear
            rows.append((module, LayerCoverage(path, "Linear", True, backend=module.kernel, scheme=module.scheme)))
            continue
        kind = layer_kind(module)
        if kind is None or path in seen or isinstance(parent, (Fused, nn.MultiheadAttention)) \
                or _computed_by_a_child(path, seen):
            continue
        if isinstance(module, TiedInt8Embedding):  # the rows of its tied INT8 head's weight
            rows.append((module, LayerCoverage(path, kind, True, f"lookup in {_head_path(gm, module)}'s int8 weight "
                                               "(tied)", backend="int8 rows", scheme=module.head.scheme)))
            continue
        if kind in _LOOKUPS:
            why = "float: lookup (no multiply-adds)"
        elif kind == "MultiheadAttention":
            why = "float: nn.MultiheadAttention computes its projections in one float op"
        else:
            why = next((r for block, r in breaks.items() if not block or path.startswith(block + ".")),
                       "not called as a module in the traced graph (unsupported pattern or config.leaf_modules)")
        rows.append((module, LayerCoverage(path, kind, False, why)))
    return rows


def _head_path(gm: fx.GraphModule, embedding: TiedInt8Embedding) -> str:
    """The user's path of the layer ``embedding`` reads: an island of that one layer answers for it."""
    path = next(p for p, m in gm.named_modules() if m is embedding.head)
    parent, _, name = path.rpartition(".")
    surface = getattr(gm.get_submodule(parent), "meta", {}).get(SURFACE_KEY) if parent else None
    if isinstance(surface, Surface) and surface.layer == name:
        return surface.path
    return path.removeprefix(f"{WRAPPED}.") if quant_state(gm).wrapped else path


def _example(gm: fx.GraphModule, example_inputs: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    if example_inputs is not None:
        return tuple(example_inputs)
    specs = quant_state(gm).example_inputs
    return tuple(spec.make() for spec in specs) if specs else None


def _macs(gm: fx.GraphModule, example_inputs: tuple[Any, ...] | None) -> dict[int, int]:
    with torch.random.fork_rng(devices=[]):  # random example inputs leave the caller's random stream as it was
        example = _example(gm, example_inputs)
        if example is None:
            return {}
        return _run_counting(gm, example)


def _run_counting(gm: fx.GraphModule, example: tuple[Any, ...]) -> dict[int, int]:
    try:
        with observers_kept(gm):  # a prepared model's observers must not take the example for calibration data
            return model_macs(gm, example)
    except Exception as error:  # coverage must not fail on an example the model does not take
        log.warning("fxquant.coverage: multiply-adds not counted: the model does not run on the example inputs "
                    "(%s: %s)", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return {}


def coverage(gm: nn.Module, example_inputs: tuple[Any, ...] | None = None) -> Coverage:
    """The coverage of a model returned by ``prepare`` (what will be INT8) or ``convert`` (what is INT8).

    ``example_inputs``: the inputs whose multiply-adds weigh the layers (default: random ones shaped like
    ``prepare``'s). Example::

        print(fxquant.coverage(qmodel))
    """
    gm = graph_of(gm)  # a drop-in model: the GraphModule behind it
    found: list[tuple[nn.Module, LayerCoverage]] = []
    breaks: dict[str, str] = {}
    counts: dict[type[nn.Module], int] = {Quantize: 0, DeQuantize: 0}
    shared: set[int] = set()  # a quantize shared by sibling islands (SharedQuantize) runs once: counted once
    for graph, prefix, state in _graphs(gm):
        breaks |= {prefix + b.path: f"inside untraceable {_block(prefix + b.path)}: {b.reason} ({b.location})"
                   for b in state.graph_breaks}
        graph_rows: list[tuple[nn.Module, LayerCoverage]] = []
        for node in graph.graph.nodes:
            if node.op != "call_module":
                continue
            module = graph.get_submodule(str(node.target))
            if isinstance(module, SharedQuantize):
                if id(module) in shared:
                    continue
                shared.add(id(module))
            kind = Quantize if isinstance(module, Quantize) else type(module)
            counts[kind] = counts.get(kind, 0) + 1
            row = _row(graph, node, prefix + str(node.target), state)
            if row is not None:
                graph_rows.append((module, row))
        found += _as_replaced_layer(graph, graph_rows)
    seen = {row.path for _, row in found}
    found += [(m, row) for m, row in _unreached(gm, seen, breaks) if not _is_island_layer(row.path, seen)]
    macs = _macs(gm, example_inputs)
    rows = tuple(replace(row, macs=macs.get(id(module), 0)) for module, row in found)
    return Coverage(rows, counts[Quantize], counts[DeQuantize], tuple(breaks.values()))


def _block(path: str) -> str:
    return f"block {path!r}" if path else "forward of the model itself"


def _is_island_layer(path: str, seen: set[str]) -> bool:
    """A single-layer island keeps its layer at ``<path>.<name>``; that layer is reported as ``<path>``."""
    parent, _, name = path.rpartition(".")
    return parent in seen and parent.rpartition(".")[2] == name

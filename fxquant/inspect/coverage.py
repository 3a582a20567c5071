"""``fxquant.coverage``: every Linear/Conv of a prepared or converted model, quantized or not, and why not."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import fx, nn

from fxquant.nn.fused import COMPUTE_TYPES, Fused
from fxquant.nn.quantized import DeQuantize, Quantize, _QuantizedWeighted
from fxquant.nn.shared_quantize import SharedQuantize
from fxquant.observers import Observer
from fxquant.passes.islands import WRAPPED
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.state import STATE_KEY, QuantState, quant_state


@dataclass(frozen=True)
class LayerCoverage:
    """One Linear/Conv: its path, float class, whether it runs INT8, why not (for an INT8 layer: a note such as
    "float output"), and on which backend."""

    path: str
    kind: str
    quantized: bool
    reason: str = ""
    backend: str = ""


@dataclass(frozen=True)
class Coverage:
    """The coverage table plus the float/int8 boundary counts (quantize and dequantize nodes)."""

    layers: tuple[LayerCoverage, ...]
    quantize_nodes: int
    dequantize_nodes: int
    graph_breaks: tuple[str, ...]

    @property
    def quantized_fraction(self) -> float:
        return sum(layer.quantized for layer in self.layers) / max(len(self.layers), 1)

    def rows(self) -> list[dict[str, object]]:
        return [asdict(layer) for layer in self.layers]

    def __str__(self) -> str:
        header = ("module", "kind", "quantized", "backend", "reason")
        rows = [header] + [(r.path, r.kind, "yes" if r.quantized else "no", r.backend, r.reason) for r in self.layers]
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        done = sum(layer.quantized for layer in self.layers)
        lines.append(f"{done}/{len(self.layers)} Linear/Conv layers INT8; {self.quantize_nodes} quantize and "
                     f"{self.dequantize_nodes} dequantize nodes")
        lines += [f"graph break: {b}" for b in self.graph_breaks]
        return "\n".join(lines)


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
    if not isinstance(inner, (*COMPUTE_TYPES, _QuantizedWeighted)):
        return None
    kind = type(inner).__name__.removeprefix("Quantized")
    if isinstance(inner, _QuantizedWeighted):
        note = "float output (from the int32 accumulator)" if getattr(inner, "float_output", False) else ""
        return LayerCoverage(path, kind, True, note, backend=inner.backend.name)
    observer = next(iter(node.users)) if len(node.users) == 1 else None
    if observer is not None and isinstance(gm.get_submodule(str(observer.target)) if observer.op == "call_module"
                                           else None, Observer):
        return LayerCoverage(path, kind, True, backend=state.config.backend)
    settings = node.meta.get(LAYER_SETTINGS)
    reason = str(settings.reason) if settings is not None and not settings.quantize else \
        "its input is not a tensor produced in the graph (unsupported pattern)"
    return LayerCoverage(path, kind, False, reason)


def _unreached(gm: fx.GraphModule, seen: set[str], breaks: dict[str, str]) -> list[LayerCoverage]:
    """Layers no graph calls: inside an untraceable block or a leaf, or used in an unsupported way."""
    rows = []
    wrapped = quant_state(gm).wrapped
    for full_path, module in gm.named_modules():
        path = full_path.removeprefix(f"{WRAPPED}.") if wrapped else full_path
        if type(module) not in COMPUTE_TYPES or path in seen or isinstance(gm.get_submodule(
                full_path.rpartition(".")[0]), Fused):
            continue
        why = next((r for block, r in breaks.items() if not block or path.startswith(block + ".")),
                   "not called as a module in the traced graph (unsupported pattern or config.leaf_modules)")
        rows.append(LayerCoverage(path, type(module).__name__, False, why))
    return rows


def coverage(gm: fx.GraphModule) -> Coverage:
    """The coverage of a model returned by ``prepare`` (what will be INT8) or ``convert`` (what is INT8).

    Example::

        print(fxquant.coverage(qmodel))
    """
    rows: list[LayerCoverage] = []
    breaks: dict[str, str] = {}
    counts: dict[type[nn.Module], int] = {Quantize: 0, DeQuantize: 0}
    shared: set[int] = set()  # a quantize shared by sibling islands (SharedQuantize) runs once: counted once
    for graph, prefix, state in _graphs(gm):
        breaks |= {prefix + b.path: f"inside untraceable {_block(prefix + b.path)}: {b.reason} ({b.location})"
                   for b in state.graph_breaks}
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
                rows.append(row)
    seen = {r.path for r in rows}
    rows += [r for r in _unreached(gm, seen, breaks) if not _is_island_layer(r.path, seen)]
    return Coverage(tuple(rows), counts[Quantize], counts[DeQuantize], tuple(breaks.values()))


def _block(path: str) -> str:
    return f"block {path!r}" if path else "forward of the model itself"


def _is_island_layer(path: str, seen: set[str]) -> bool:
    """A single-layer island keeps its layer at ``<path>.<name>``; that layer is reported as ``<path>``."""
    parent, _, name = path.rpartition(".")
    return parent in seen and parent.rpartition(".")[2] == name

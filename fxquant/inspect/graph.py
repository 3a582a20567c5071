"""The FX graph as a table (opcode, name, target, args, kwargs) with each node's quantization role marked."""

from __future__ import annotations

import sys
from typing import TextIO

from torch import fx, nn

from fxquant.nn.fused import Fused
from fxquant.nn.quantized import DeQuantize, Quantize, _BackendModule
from fxquant.nn.schemes import SchemeLinear
from fxquant.observers import Observer
from fxquant.state import graph_of


def node_role(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    """``observer`` (an activation's range), ``statistics`` (for SmoothQuant or bias correction at convert),
    ``quantize``, ``dequantize``, ``int8[<backend>]``, ``int8[<scheme>]`` (a dynamic or weight-only Linear, float in
    and out) or empty for float nodes."""
    if node.op != "call_module":
        return ""
    module = modules.get(str(node.target))
    if isinstance(module, Observer):
        return "observer" if module.kind == "activation" else module.kind
    if isinstance(module, Quantize):
        return "quantize"
    if isinstance(module, DeQuantize):
        return "dequantize"
    if isinstance(module, _BackendModule):
        return f"int8[{module.backend.name}]"
    inner = module.inner if isinstance(module, Fused) else module
    if isinstance(inner, SchemeLinear):
        return f"int8[{inner.scheme}]"
    return ""


def _short(value: object, width: int = 48) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_graph(gm: nn.Module) -> str:
    """The table ``print_graph`` prints, as a string."""
    gm = graph_of(gm)  # a drop-in model: the GraphModule behind it
    modules = dict(gm.named_modules())
    header = ("opcode", "name", "target", "args", "kwargs", "quant")
    rows = [header]
    for node in gm.graph.nodes:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
        rows.append((node.op, node.name, _short(target), _short(node.args), _short(node.kwargs),
                     node_role(node, modules)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_graph(gm: nn.Module, file: TextIO | None = None) -> None:
    """Print the graph of ``gm`` as a table, like ``graph.print_tabular()`` plus a quantization column.

    Example::

        fxquant.print_graph(fxquant.convert(prepared))
    """
    print(format_graph(gm), file=file or sys.stdout)

"""A readable, deterministic summary of a GraphModule, and the check that a rebuilt graph still matches it.

An artifact stores observer statistics, not code; it is only valid for the graph those statistics were recorded on.
Each node becomes one line (op, name, target, arguments) and each state-dict entry one line (dtype, shape), so a
mismatch can be reported as the first line that differs rather than as two unequal hashes.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import fx, nn

from fxquant.errors import ArtifactError
from fxquant.serialization import sha256_bytes

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _describe(value: Any) -> str:
    """A stable text for a node argument: node names, literals, or the type of anything else (no addresses)."""
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_describe(value.start)}, {_describe(value.stop)}, {_describe(value.step)})"
    if isinstance(value, (*_PLAIN, enum.Enum)):
        return repr(value)
    return f"<{type(value).__name__}>"


def _target(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    if node.op == "call_module":
        return f"{node.target}:{type(modules[str(node.target)]).__name__}"
    if callable(node.target):
        module = getattr(node.target, "__module__", None) or ""
        return f"{module}.{getattr(node.target, '__qualname__', getattr(node.target, '__name__', '?'))}"
    return str(node.target)


def graph_summary(gm: fx.GraphModule) -> list[str]:
    """One line per node and per state-dict tensor, in graph order."""
    modules = dict(gm.named_modules())
    lines = [f"{node.op} {node.name} {_target(node, modules)} {_describe(node.args)} {_describe(node.kwargs)}"
             for node in gm.graph.nodes]
    lines += [f"tensor {key} {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
              for key, value in gm.state_dict().items() if isinstance(value, torch.Tensor)]
    return lines


def fingerprint(lines: list[str]) -> str:
    return sha256_bytes("\n".join(lines).encode())


def check_graph(gm: fx.GraphModule, expected: list[str], what: str) -> None:
    """Raise ``ArtifactError`` naming the first difference between ``gm`` and the stored ``expected`` summary."""
    actual = graph_summary(gm)
    if actual == expected:
        return
    for index, (old, new) in enumerate(zip(expected, actual, strict=False)):
        if old != new:
            detail = f"line {index + 1} of the {what} graph was {old!r}, the model now gives {new!r}"
            break
    else:
        detail = (f"the {what} graph had {len(expected)} lines, the model now gives {len(actual)}")
    raise ArtifactError(f"the model's graph no longer matches the artifact: {detail}. Pass the model (and weights) "
                        "the artifact was made from, or re-run quantization on the changed model")

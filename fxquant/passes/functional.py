"""Turn ``F.linear`` / ``F.convNd`` / ``torch.addmm`` calls on module parameters into module calls, so they fold, fuse
and quantize.

This is what makes subclasses of ``nn.Conv2d``/``nn.Linear`` with their own ``forward`` (a "same"-padding conv
that pads and then calls ``F.conv2d(x, self.weight, ...)``) quantizable: torch.fx traces into them, and this pass
gives the call back a plain module at the owner's path, keeping the user's parameter objects. ``torch.addmm(bias,
x, weight)`` with a ``(in, out)`` weight is a Linear with the weight transposed: transformers' ``Conv1D`` (GPT-2's
projections) computes exactly that; the Linear holds a transposed view of the same parameter, so ``F.linear`` makes
the same ``addmm`` call and the prepared model computes what the float one does, bit for bit.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.passes._graph import finish, nodes_of, replace_submodule

_CONV: dict[Any, type[nn.Module]] = {F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d}
_MATMUL = (operator.matmul, torch.matmul)
_CONV_PARAMS = ("stride", "padding", "dilation", "groups")
_CONV_DEFAULTS: dict[str, Any] = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _param(gm: fx.GraphModule, arg: Any) -> nn.Parameter | None:
    if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
        return None
    return gm.get_parameter(str(arg.target)) if _is_parameter(gm, str(arg.target)) else None


def _is_parameter(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def _module_for(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """An equivalent nn.Linear/nn.ConvNd sharing the call's parameters, or None if it cannot be expressed."""
    args = dict(zip(("input", "weight", "bias", *_CONV_PARAMS), node.args, strict=False)) | dict(node.kwargs)
    weight, bias = _param(gm, args.get("weight")), _param(gm, args.get("bias"))
    if weight is None or (args.get("bias") is not None and bias is None):
        return None
    if node.target is F.linear:
        module: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    else:
        options = {k: args.get(k, _CONV_DEFAULTS[k]) for k in _CONV_PARAMS}
        if isinstance(options["padding"], str) or any(isinstance(v, fx.Node) for v in options.values()):
            return None  # string or traced padding: leave the call as it is (float)
        groups = int(options["groups"])
        module = _CONV[node.target](weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]),
                                    bias=bias is not None, device="meta", **options)
    module.register_parameter("weight", weight)
    module.register_parameter("bias", bias)
    return module


def _transposed_param(gm: fx.GraphModule, arg: Any) -> nn.Parameter | None:
    """The 2-d parameter ``arg`` reads as ``param.T`` / ``param.t()``, else None."""
    if not isinstance(arg, fx.Node) or len(arg.args) < 1:
        return None
    is_t = (arg.op == "call_function" and arg.target is getattr and arg.args[1:] == ("T",)) or (
        arg.op == "call_method" and arg.target == "t" and len(arg.args) == 1)
    weight = _param(gm, arg.args[0]) if is_t else None
    return weight if weight is not None and weight.dim() == 2 else None


def _linear_from_matmul(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """``x @ weight.T`` (Falcon's Linear): a Linear without bias over the same parameter."""
    weight = _transposed_param(gm, node.args[1]) if len(node.args) == 2 and not node.kwargs else None
    if weight is None:
        return None
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    module.register_parameter("weight", weight)
    return module


def _linear_from_addmm(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """``torch.addmm(bias, x, weight)`` with parameters, default ``beta``/``alpha``: a Linear over ``weight.t()``."""
    args = dict(zip(("input", "mat1", "mat2"), node.args, strict=False)) | dict(node.kwargs)
    weight, bias = _param(gm, args.get("mat2")), _param(gm, args.get("input"))
    if weight is None or bias is None or weight.dim() != 2 or bias.dim() != 1 or set(args) - {"input", "mat1", "mat2"}:
        return None
    module = nn.Linear(weight.shape[0], weight.shape[1], device="meta")
    module.weight = nn.Parameter(weight.t(), requires_grad=weight.requires_grad)  # a view: no copy
    module.register_parameter("bias", bias)
    return module


def _weight_argument(node: fx.Node) -> fx.Node:
    if node.target in _MATMUL:
        weight = node.args[1].args[0]  # type: ignore[union-attr]  # checked by _transposed_param
    elif node.target is torch.addmm:
        weight = node.args[2] if len(node.args) > 2 else node.kwargs["mat2"]
    else:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
    assert isinstance(weight, fx.Node)
    return weight


def _owner_path(gm: fx.GraphModule, node: fx.Node) -> str:
    """The path of the module owning the weight (the user's name for the layer) when the new module can take its
    place: the graph reads nothing else from it and calls neither it nor any of its children (a "same"-padding conv
    calls its own ``static_padding`` child first). Otherwise a new child of the owner, so the owner keeps everything
    the graph still uses and the layer keeps a path under it (config patterns, coverage)."""
    weight = _weight_argument(node)
    owner = str(weight.target).rpartition(".")[0]
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith(f"{owner}.")}
    inside = any(path == owner or path.startswith(f"{owner}.") for path in called)
    if owner and read <= {f"{owner}.weight", f"{owner}.bias"} and not inside:
        return owner
    parent = gm.get_submodule(owner)
    name = node.name
    while hasattr(parent, name):
        name += "_"
    return f"{owner}.{name}" if owner else name


def functional_to_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``F.linear/convNd(x, <param>, <param>, ...)``, ``torch.addmm(<param>, x, <param>)`` and ``x @
    <param>.T`` into calls of modules at the parameters' owner path."""
    for node in nodes_of(gm):
        if node.op != "call_function":
            continue
        if node.target is torch.addmm:
            module, x = _linear_from_addmm(gm, node), node.args[1] if len(node.args) > 1 else node.kwargs.get("mat1")
        elif node.target in _MATMUL:
            module, x = _linear_from_matmul(gm, node), node.args[0]
        elif node.target is F.linear or node.target in _CONV:
            module, x = _module_for(gm, node), node.args[0] if node.args else node.kwargs["input"]
        else:
            continue
        if module is None:
            continue
        path = _owner_path(gm, node)
        replace_submodule(gm, path, module)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(path, (x,))
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
    return finish(gm)

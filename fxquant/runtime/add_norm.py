"""A transformer's residual add and the LayerNorm after it, ``norm(a + b)``, as one step of a converted model's
forward: fxquant's loop where it computes the same function, torch's two ops for every other call.

Once the Linears are INT8, the float code between them is a large share of what is left, and most of it is
``LayerNorm(x + dense(x))`` (BERT's post-LN blocks, twice per layer): torch's add writes the sum out as a new tensor
and the LayerNorm reads it back, both at memory speed at encoder sizes. :func:`fxquant.native.layer_norm.
add_layer_norm_into` keeps each row's sum in L1 between the row's passes (docs/backends.md, "Residual add +
LayerNorm", has the measurements). The graph walk (:mod:`fxquant.runtime.runner`) makes one
:class:`AddLayerNorm` step of each such pair (:func:`pairs`) where the model runs INT8 layers on a kernel backend;
the graph and its generated code keep both ops, so an export, a traced or hooked call and the reference backend
compute with torch's.

A call takes the loop only where it computes the same function: the LayerNorm module an ``nn.LayerNorm`` over the
last dim (its weight and bias, if any, float32), both addends contiguous float32 CPU tensors of one shape, or one
broadcasting over the other's leading dims (token + position embeddings), no autograd, not under a tracer or
compiler, no hooks on the LayerNorm. Results differ from torch's by float32 rounding only (the loop sums in another
order; tests/kernels/test_layer_norm_kernel.py compares both with a float64 reference).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn

from fxquant.native.layer_norm import add_layer_norm_into
from fxquant.runtime.step import hooked, module_at, run_layer

ADD = (operator.add, torch.add)  # what traced graphs call for ``a + b``
_PLAIN = (torch.Tensor, nn.Parameter)  # no subclass: the loop reads the memory behind data_ptr()


def pairs(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each ``a + b`` node of ``gm`` (two tensor nodes, no ``alpha``) whose only reader is an ``nn.LayerNorm`` over the
    last dim called on it alone, mapped to that LayerNorm's node."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ADD or node.kwargs or len(node.args) != 2 \
                or not all(isinstance(arg, fx.Node) for arg in node.args) or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op == "call_module" and user.args == (node,) and not user.kwargs \
                and _norm_over_last_dim(gm.get_submodule(str(user.target))):
            found[node] = user
    return found


def _norm_over_last_dim(module: nn.Module) -> bool:
    return type(module) is nn.LayerNorm and len(module.normalized_shape) == 1


def _affine(tensor: torch.Tensor | None, width: int) -> bool:
    return tensor is None or (type(tensor) in _PLAIN and tensor.dtype == torch.float32
                              and tensor.device.type == "cpu" and tensor.shape == (width,) and tensor.is_contiguous())


def _repeats_over(b: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``b`` has ``a``'s shape, or its trailing dims with leading ones (its rows repeat over ``a``'s)."""
    dims = b.dim() - next((i for i, size in enumerate(b.shape) if size != 1), b.dim())
    return b.dim() <= a.dim() and b.shape[b.dim() - dims:] == a.shape[a.dim() - dims:] and dims >= 1


def fused(a: Any, b: Any, norm: nn.Module) -> torch.Tensor | None:
    """``norm(a + b)`` from the loop; None where it does not compute this call (module docstring)."""
    if not (type(a) is torch.Tensor and type(b) is torch.Tensor and isinstance(norm, nn.LayerNorm)
            and _norm_over_last_dim(norm)):
        return None
    if b.numel() > a.numel():  # the sum is commutative, bit for bit: the broadcast operand goes second
        a, b = b, a
    width = norm.normalized_shape[0]
    weight, bias = norm.weight, norm.bias
    if not (a.dtype == b.dtype == torch.float32 and a.device.type == b.device.type == "cpu" and a.dim() >= 1
            and a.shape[-1] == width and a.numel() and _repeats_over(b, a) and a.is_contiguous()
            and b.is_contiguous() and _affine(weight, width) and _affine(bias, width)
            and (bias is None or weight is not None)):
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, weight, bias)):
        return None
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return None
    out = torch.empty_like(a)
    return out if add_layer_norm_into(out, a, b, weight, bias, norm.eps) else None


class AddLayerNorm:
    """The runner's step for one pair of :func:`pairs`: reads the addends from their slots, writes the LayerNorm's
    value into its slot; the LayerNorm module is found on every call, as the runner finds modules."""

    def __init__(self, add: Any, addends: tuple[int, int], norm: tuple[str, ...], out: int) -> None:
        self.add = add
        self.addends = addends
        self.norm = norm
        self.out = out

    def __call__(self, env: list[Any], gm: nn.Module, plain: bool) -> None:
        a, b = env[self.addends[0]], env[self.addends[1]]
        norm = module_at(gm, self.norm)
        value = fused(a, b, norm) if plain and not hooked(norm) else None
        env[self.out] = value if value is not None else run_layer(norm, [self.add(a, b)], plain)

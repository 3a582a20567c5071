"""Models described by data: a ``ModelSpec`` is a list of op records, ``SpecModel`` runs it.

The spec is a Python constant, so ``SpecModel.forward`` is a plain loop that torch.fx unrolls: no data-dependent
control flow. Value 0 is the input; op ``i`` reads the values ``op.src`` and appends value ``i + 1``; the model
returns the last value. Shapes exclude the batch dimension: ``(F,)``, ``(C, L)`` or ``(C, H, W)``.

``Op.args`` by kind (every spec prints as Python, so a shrunk failure can be pasted into an ``@example``):

=========  ====================================================  =====================================
kind       args                                                  forms
=========  ====================================================  =====================================
conv       (out_channels, kernel, stride, padding, dilation,     module, functional (``F.convNd`` on
           groups, bias) -- Conv1d on (C, L), Conv2d on          the module's parameters)
           (C, H, W)
linear     (out_features, bias) -- on the last dim               module, functional
bn         (seed,) -- BatchNorm1d/2d with random statistics      module, functional
act        (name,): relu, relu6, hardtanh, gelu, sigmoid         module, functional, method
pool       (name, kernel, stride, padding): max, avg, adaptive   module, functional
add        (relu,) -- two values of one shape                    operator, torch
mul        () -- two values of one shape                         operator, torch
cat        () -- two values that differ in dim 1 only            torch
flatten    ()                                                    module, function, method, view, reshape
reshape    (shape,) -- the new shape without the batch dim       method, view, function
=========  ====================================================  =====================================
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Op:
    kind: str
    src: tuple[int, ...]
    args: tuple[Any, ...] = ()
    form: str = "module"


@dataclass(frozen=True)
class ModelSpec:
    input_shape: Shape
    ops: tuple[Op, ...]
    seed: int = 0

    def shapes(self) -> list[Shape]:
        """The shape of every value: the input's, then each op's output."""
        shapes = [self.input_shape]
        for op in self.ops:
            shapes.append(out_shape(op, [shapes[i] for i in op.src]))
        return shapes


def conv_length(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def out_shape(op: Op, inputs: list[Shape]) -> Shape:
    """The output shape of ``op`` given its inputs' shapes (the one place this arithmetic lives)."""
    shape = inputs[0]
    if op.kind == "conv":
        out, kernel, stride, padding, dilation = op.args[:5]
        return (out, *(conv_length(s, kernel, stride, padding, dilation) for s in shape[1:]))
    if op.kind == "linear":
        return (*shape[:-1], op.args[0])
    if op.kind == "pool":
        name, kernel, stride, padding = op.args
        if name == "adaptive":
            return (shape[0], *([kernel] * (len(shape) - 1)))
        return (shape[0], *(conv_length(s, kernel, stride, padding, 1) for s in shape[1:]))
    if op.kind == "cat":
        return (shape[0] + inputs[1][0], *shape[1:])
    if op.kind == "flatten":
        return (math.prod(shape),)
    if op.kind == "reshape":
        return tuple(op.args[0])
    return shape  # bn, act, add, mul


_JOINS: dict[tuple[str, str], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    ("add", "operator"): operator.add, ("add", "torch"): torch.add, ("mul", "operator"): operator.mul,
    ("mul", "torch"): torch.mul,
}
_ACT_MODULES: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "hardtanh": lambda: nn.Hardtanh(-1.0, 2.0), "gelu": nn.GELU,
    "sigmoid": nn.Sigmoid,
}
_ACT_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "relu6": F.relu6, "hardtanh": lambda x: F.hardtanh(x, -1.0, 2.0), "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
}
_POOL_MODULES: dict[tuple[str, int], Callable[..., nn.Module]] = {
    ("max", 1): nn.MaxPool1d, ("max", 2): nn.MaxPool2d, ("avg", 1): nn.AvgPool1d, ("avg", 2): nn.AvgPool2d,
}
_POOL_FUNCTIONS: dict[tuple[str, int], Callable[..., torch.Tensor]] = {
    ("max", 1): F.max_pool1d, ("max", 2): F.max_pool2d, ("avg", 1): F.avg_pool1d, ("avg", 2): F.avg_pool2d,
    ("adaptive", 1): F.adaptive_avg_pool1d, ("adaptive", 2): F.adaptive_avg_pool2d,
}


def _batchnorm(channels: int, rank: int, seed: int) -> nn.Module:
    bn = (nn.BatchNorm2d if rank == 3 else nn.BatchNorm1d)(channels)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.running_mean.normal_(0.0, 1.0, generator=generator)  # type: ignore[union-attr]
        # some channels nearly constant (var 1e-4) so that folding scales their weights up by ~100
        bn.running_var.uniform_(1e-4, 4.0, generator=generator)  # type: ignore[union-attr]
        bn.weight.normal_(1.0, 0.5, generator=generator)
        bn.bias.normal_(0.0, 0.5, generator=generator)
    return bn


def build_layer(op: Op, shape: Shape) -> nn.Module | None:
    """The module ``op`` owns (also for functional forms, which call ``F`` on its parameters)."""
    if op.kind == "conv":
        out, kernel, stride, padding, dilation, groups, bias = op.args
        conv = nn.Conv1d if len(shape) == 2 else nn.Conv2d
        return conv(shape[0], out, kernel, stride, padding, dilation, groups, bias)
    if op.kind == "linear":
        return nn.Linear(shape[-1], op.args[0], bias=op.args[1])
    if op.kind == "bn":
        return _batchnorm(shape[0], len(shape), op.args[0])
    if op.kind == "act" and op.form == "module":
        return _ACT_MODULES[op.args[0]]()
    if op.kind == "pool" and op.form == "module":
        name, kernel, stride, padding = op.args
        dim = len(shape) - 1
        if name == "adaptive":
            return (nn.AdaptiveAvgPool1d if dim == 1 else nn.AdaptiveAvgPool2d)(kernel)
        return _POOL_MODULES[name, dim](kernel, stride, padding)
    if op.kind == "flatten" and op.form == "module":
        return nn.Flatten()
    return None


class SpecModel(nn.Module):
    """Runs a :class:`ModelSpec`; weights are seeded by ``spec.seed``. Returned in eval mode."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.layers = nn.ModuleDict()
        shapes = spec.shapes()
        self.ranks = tuple(len(shapes[op.src[0]]) for op in spec.ops)  # torch.fx sees x.dim() as a Proxy
        for index, op in enumerate(spec.ops):
            layer = build_layer(op, shapes[op.src[0]])
            if layer is not None:
                self.layers[f"op{index}"] = layer
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for index, op in enumerate(self.spec.ops):
            layer = getattr(self.layers, f"op{index}", None)
            values.append(apply(op, layer, [values[i] for i in op.src], self.ranks[index]))
        return values[-1]


def apply(op: Op, layer: nn.Module | None, xs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Run one op; ``layer`` is what :func:`build_layer` made for it, ``rank`` that of ``xs[0]`` without batch."""
    x = xs[0]
    if op.kind in ("conv", "linear", "bn") and op.form == "functional":
        return _functional(op, layer, x)
    if layer is not None:
        return layer(x)
    if op.kind == "act":
        return x.relu() if op.form == "method" and op.args[0] == "relu" else _ACT_FUNCTIONS[op.args[0]](x)
    if op.kind == "pool":
        name, kernel, stride, padding = op.args
        fn = _POOL_FUNCTIONS[name, rank - 1]
        return fn(x, kernel) if name == "adaptive" else fn(x, kernel, stride, padding)
    if op.kind in ("add", "mul"):
        join = _JOINS[op.kind, op.form]
        total = join(x, xs[1])
        return F.relu(total) if op.args and op.args[0] else total
    if op.kind == "cat":
        return torch.cat([x, xs[1]], 1)
    if op.kind == "flatten":
        return _flatten(x, op.form)
    assert op.kind == "reshape", op
    shape = (-1, *op.args[0])
    if op.form == "view":
        return x.view(*shape)
    return x.reshape(*shape) if op.form == "method" else torch.reshape(x, shape)


def _functional(op: Op, layer: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, nn.Linear):
        return F.linear(x, layer.weight, layer.bias)
    if isinstance(layer, nn.modules.batchnorm._BatchNorm):
        return F.batch_norm(x, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0,
                            layer.eps)
    assert isinstance(layer, (nn.Conv1d, nn.Conv2d)), op
    conv = F.conv1d if isinstance(layer, nn.Conv1d) else F.conv2d
    return conv(x, layer.weight, layer.bias, layer.stride, layer.padding, layer.dilation, layer.groups)


def _flatten(x: torch.Tensor, form: str) -> torch.Tensor:
    if form == "function":
        return torch.flatten(x, 1)
    if form == "method":
        return x.flatten(1)
    if form == "view":
        return x.view(x.size(0), -1)
    return x.reshape(x.shape[0], -1)

"""What each FX node means for quantization: the one table prepare and convert both read.

* ``COMPUTE``: a Linear/Conv (maybe fused with its activation): int8 kernel, needs an int8 input, observed output.
* ``BINARY``: residual add (+ReLU) and element-wise mul of two tensors: int8 kernel when an input is already int8,
  observed output.
* ``JOIN``: ``torch.cat`` of a list of tensors: int8 when an input is, requantized to an observed output.
* ``VALUE``: ReLU, max/average pooling: int8 when the input is, output keeps the input's qparams (a backend kernel).
* ``FIXED``: sigmoid, hardsigmoid, tanh: int8 when the input is, output qparams fixed by the function's range
  (``value_ops.fixed_qparams``), so no observer (squeeze-excitation gates stay int8 into their multiply).
* ``STRUCTURAL``: reshapes, indexing, dropout: any tensor, int8 or float, output keeps the qparams.
* ``META``: ``x.size()``, ``x.dim()``, ``x.shape``: read metadata only; never force a dequantize.
* ``FLOAT``: everything else; int8 inputs are dequantized first.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.nn.fused import add_relu, compute_module
from fxquant.passes.value_ops import (
    FIXED_FUNCTIONS,
    FIXED_METHODS,
    FIXED_MODULES,
    POOL_FUNCTIONS,
    POOL_MODULES,
)


class OpKind(enum.Enum):
    COMPUTE = "compute"
    BINARY = "binary"
    JOIN = "join"
    VALUE = "value"
    FIXED = "fixed"
    STRUCTURAL = "structural"
    META = "meta"
    FLOAT = "float"


_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add, add_relu}
_MUL_FUNCTIONS = {operator.mul, operator.imul, torch.mul}
_VALUE_FUNCTIONS = {F.relu, torch.relu} | POOL_FUNCTIONS
_VALUE_MODULES: tuple[type[nn.Module], ...] = (nn.ReLU, *POOL_MODULES)
_STRUCTURAL_FUNCTIONS = {torch.flatten, torch.reshape, torch.permute, torch.transpose, torch.squeeze,
                         torch.unsqueeze, torch.chunk, torch.split, operator.getitem, F.dropout, F.dropout1d,
                         F.dropout2d}
_STRUCTURAL_METHODS = {"flatten", "reshape", "view", "permute", "transpose", "contiguous", "squeeze",
                       "unsqueeze", "chunk", "split"}
_STRUCTURAL_MODULES = (nn.Flatten, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Identity)
_META_METHODS = {"size", "dim", "numel"}
_META_ATTRS = {"shape", "dtype", "device", "ndim"}


def classify(node: fx.Node, modules: Mapping[str, nn.Module]) -> OpKind:
    """The kind of ``node``; ``modules`` is ``dict(gm.named_modules())``."""
    if node.op == "call_module":
        return _classify_module(modules[str(node.target)])
    if node.op == "call_function":
        return _classify_function(node)
    if node.op == "call_method":
        return _classify_method(node)
    return OpKind.FLOAT


def _classify_module(m: nn.Module) -> OpKind:
    if compute_module(m) is not None:
        return OpKind.COMPUTE
    if isinstance(m, _VALUE_MODULES):
        return OpKind.VALUE
    if type(m) in FIXED_MODULES:
        return OpKind.FIXED
    if isinstance(m, _STRUCTURAL_MODULES):
        return OpKind.STRUCTURAL
    return OpKind.FLOAT


def _classify_function(node: fx.Node) -> OpKind:
    target = node.target
    if target in _ADD_FUNCTIONS or target in _MUL_FUNCTIONS:
        return OpKind.BINARY if _two_tensor_nodes(node) else OpKind.FLOAT
    if target in (torch.cat, torch.concat) and join_inputs(node):
        return OpKind.JOIN
    if target in _VALUE_FUNCTIONS:
        return OpKind.VALUE
    if target in FIXED_FUNCTIONS:
        return OpKind.FIXED
    if target in _STRUCTURAL_FUNCTIONS:
        return OpKind.STRUCTURAL
    if target is getattr and len(node.args) > 1 and node.args[1] in _META_ATTRS:
        return OpKind.META
    return OpKind.FLOAT


def _classify_method(node: fx.Node) -> OpKind:
    if node.target in ("add", "mul") and _two_tensor_nodes(node):
        return OpKind.BINARY
    if node.target in ("relu", "relu_"):
        return OpKind.VALUE
    if node.target in FIXED_METHODS:
        return OpKind.FIXED
    if node.target in _STRUCTURAL_METHODS:
        return OpKind.STRUCTURAL
    if node.target in _META_METHODS:
        return OpKind.META
    return OpKind.FLOAT


def _two_tensor_nodes(node: fx.Node) -> bool:
    args = node.args[:2]
    return len(args) == 2 and all(isinstance(a, fx.Node) for a in args) and not node.kwargs.get("alpha")


def is_mul(node: fx.Node) -> bool:
    return node.target in _MUL_FUNCTIONS or (node.op == "call_method" and node.target == "mul")


def join_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensors ``torch.cat`` joins, when they are all graph values (else empty)."""
    values = node.args[0] if node.args else node.kwargs.get("tensors")
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, fx.Node) for v in values):
        return list(values)
    return []


def join_dim(node: fx.Node) -> int:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return int(dim)  # type: ignore[arg-type]


def tensor_input(node: fx.Node) -> fx.Node | None:
    """The tensor a unary op reads (its first argument), if it is a graph value."""
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def is_relu(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[str(node.target)], nn.ReLU)
    if node.op == "call_function":
        return node.target in (F.relu, torch.relu)
    return node.op == "call_method" and node.target in ("relu", "relu_")

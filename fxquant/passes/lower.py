"""Lower a calibrated graph to INT8: observers become qparams, float Linear/Conv/add become INT8 modules.

A value is int8 from the first quantized op to the last: ReLU, pooling and reshapes in between stay int8, a
``Quantize`` node marks where a float value enters and a ``DeQuantize`` node where an int8 value reaches a float op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from fxquant.config import LayerSettings, QuantConfig
from fxquant.errors import BackendUnavailableError
from fxquant.kernels.base import Backend, ConvSpec
from fxquant.kernels.registry import get_backend
from fxquant.nn.fixed_range import QuantizedFixedRange
from fxquant.nn.fused import Fused, add_relu, compute_module
from fxquant.nn.quantized import (
    QUANTIZED_CONV,
    QUANTIZED_CONV_TRANSPOSE,
    DeQuantize,
    Quantize,
    QuantizedAdd,
    QuantizedCat,
    QuantizedLinear,
    QuantizedMul,
    QuantizedPool,
    QuantizedReLU,
    _QuantizedWeighted,
)
from fxquant.observers import Observer, get_weight_observer
from fxquant.passes._graph import finish, modules_of, nodes_of, only_user, replace_submodule
from fxquant.passes.fuse_lowered import fuse_lowered
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind, classify, is_mul, join_dim, join_inputs, tensor_input
from fxquant.passes.share_qparams import share_join_qparams
from fxquant.passes.value_ops import fixed_function, fixed_qparams, pool_options
from fxquant.qparams import QParams, quantize

_DROPPED = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Identity)
_INT32_MAX = 2**31 - 1
log = logging.getLogger(__name__)


@dataclass
class _Lowering:
    gm: fx.GraphModule
    config: QuantConfig
    backend: Backend
    modules: dict[str, nn.Module]
    activation_qparams: dict[str, QParams]
    qparams: dict[fx.Node, QParams] = field(default_factory=dict)
    dequantized: dict[fx.Node, fx.Node] = field(default_factory=dict)
    count: int = 0

    def add_module(self, prefix: str, module: nn.Module) -> str:
        name = f"{prefix}_{self.count}"
        self.count += 1
        self.gm.add_submodule(name, module)
        return name

    def swap_to_module(self, node: fx.Node, prefix: str, module: nn.Module, args: tuple) -> fx.Node:
        name = self.add_module(prefix, module)
        with self.gm.graph.inserting_before(node):
            new = self.gm.graph.call_module(name, args)
        node.replace_all_uses_with(new)
        self.gm.graph.erase_node(node)
        return new


def _observer(low: _Lowering, node: fx.Node | None) -> Observer | None:
    if node is None or node.op != "call_module":
        return None
    module = low.modules.get(str(node.target))
    return module if isinstance(module, Observer) else None


def _feeds_grouped_conv(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether an int8 value reaches a grouped conv (through int8-preserving ops): fbgemm needs 7 bits there."""
    for user in node.users:
        kind = classify(user, modules)
        if kind is OpKind.COMPUTE:
            inner = compute_module(modules[str(user.target)])
            if isinstance(inner, nn.modules.conv._ConvNd) and inner.groups > 1:
                return True
        elif kind in (OpKind.VALUE, OpKind.STRUCTURAL) and _feeds_grouped_conv(user, modules):
            return True
    return False


def observer_qparams(gm: fx.GraphModule, backend: Backend) -> dict[str, QParams]:
    """The activation qparams each observer of a calibrated graph gives on ``backend`` (by observer name).

    The integer range depends on the backend and on what consumes the value, so it is decided here, once, for
    both lowering and the fake-quant simulation that tests compare against.
    """
    modules = modules_of(gm)
    result = {}
    for node in gm.graph.nodes:
        observer = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(observer, Observer):
            grouped = _feeds_grouped_conv(node, modules)
            result[str(node.target)] = observer.qparams(backend.activation_qrange(feeds_grouped_conv=grouped))
    return share_join_qparams(gm, modules, result)


def _output_qparams(low: _Lowering, obs_node: fx.Node) -> QParams:
    return low.activation_qparams[str(obs_node.target)]


def _absorb_observer(low: _Lowering, node: fx.Node) -> tuple[fx.Node, QParams]:
    """Remove the observer after ``node``; return it and the qparams the observer chose."""
    obs_node = next(iter(node.users))
    out_qp = _output_qparams(low, obs_node)
    obs_node.replace_all_uses_with(node)
    low.gm.graph.erase_node(obs_node)
    return node, out_qp


def weight_qparams(settings: LayerSettings, layer: nn.Linear | nn.modules.conv._ConvNd) -> QParams:
    """Symmetric int8 qparams of ``layer``'s weight with the layer's weight observer.

    Transposed convolutions get per-tensor weights: no int8 kernel accepts per-channel transposed weights.
    """
    scheme = settings.weight
    if isinstance(layer, nn.modules.conv._ConvTransposeNd):
        scheme = "per_tensor"
    return get_weight_observer(scheme)().qparams(layer.weight)


def _lower_compute(low: _Lowering, node: fx.Node) -> None:
    path = str(node.target)
    module = low.modules[path]
    inner = compute_module(module)
    assert inner is not None
    in_qp = low.qparams[tensor_input(node)]  # type: ignore[index]
    node, out_qp = _absorb_observer(low, node)
    w_qp = weight_qparams(node.meta[LAYER_SETTINGS], inner)
    relu = isinstance(module, Fused) and module.min_val == 0.0
    parts = (quantize(inner.weight.detach(), w_qp), w_qp, inner.bias, (in_qp, out_qp))
    try:
        qmodule = _quantized_layer(inner, parts, relu, low.backend)
    except BackendUnavailableError as error:
        if low.backend.fallback is None:
            raise BackendUnavailableError(f"layer {path!r}: {error}") from None
        # same activation representation, so the layer can run on the fallback with no conversion around it
        log.warning("fxquant: %s runs on %r: %s", path, low.backend.fallback, error)
        qmodule = _quantized_layer(inner, parts, relu, get_backend(low.backend.fallback))
    qmodule.range_clamp = isinstance(module, Fused) and (module.max_val is not None or module.min_val != 0.0)
    replace_submodule(low.gm, path, qmodule)
    low.qparams[node] = out_qp


def _check_accumulator(inner: nn.Module, parts: tuple, backend: Backend) -> None:
    """Refuse a layer whose worst-case accumulator ``sum((q_x - zp) * q_w)`` (plus the bias, where the backend
    rounds it to int32 at scale ``s_x * s_w``) does not fit in int32: the kernels would wrap around silently.
    Real layers are far from it: it takes ~65k inputs per output at full-scale weights, or a bias ~1e9 steps
    large (an input that was constant in calibration gets a ~1e-7 scale); wrap-around of the kernels'
    intermediate sums is harmless, only the final sum must fit."""
    q_weight, w_qp, bias, (in_qp, _) = parts
    if not backend.int32_accumulator:
        return
    axis = 1 if isinstance(inner, nn.modules.conv._ConvTransposeNd) else 0
    worst = q_weight.to(torch.float64).abs().sum([d for d in range(q_weight.dim()) if d != axis])
    zero_point = int(in_qp.zero_point)
    worst *= max(zero_point - in_qp.qmin, in_qp.qmax - zero_point)
    if backend.int32_bias and bias is not None:
        worst += torch.round(bias.detach().double() / (float(in_qp.scale) * w_qp.scale.double())).abs()
    if float(worst.max()) > _INT32_MAX:
        raise BackendUnavailableError(
            f"the {backend.name} backend sums int8 products in int32, which inputs at the edges of the calibrated "
            f"range would overflow ({float(worst.max()):.3g} > 2**31 - 1 with {q_weight[0].numel()} inputs per "
            f"output, input scale {float(in_qp.scale):.3g}); use the 'reference' backend or exclude this layer "
            "from quantization")


def _quantized_layer(inner: nn.Module, parts: tuple, relu: bool, backend: Backend) -> _QuantizedWeighted:
    _check_accumulator(inner, parts, backend)
    if isinstance(inner, nn.Linear):
        return QuantizedLinear(*parts, relu=relu, backend=backend)
    assert isinstance(inner, nn.modules.conv._ConvNd)
    spec = ConvSpec(len(inner.kernel_size), tuple(inner.stride), tuple(inner.padding),  # type: ignore[arg-type]
                    tuple(inner.dilation), inner.groups, inner.transposed, tuple(inner.output_padding))
    table = QUANTIZED_CONV_TRANSPOSE if spec.transposed else QUANTIZED_CONV
    return table[spec.dim](spec, *parts, relu=relu, backend=backend)


def _lower_binary(low: _Lowering, node: fx.Node) -> None:
    a, b = node.args[:2]
    qa, qb = low.qparams[a], low.qparams[b]  # type: ignore[index]
    mul = is_mul(node)
    node, out_qp = _absorb_observer(low, node)
    module: nn.Module = (QuantizedMul(qa, qb, out_qp, backend=low.backend) if mul else
                         QuantizedAdd(qa, qb, out_qp, relu=node.target is add_relu, backend=low.backend))
    low.qparams[low.swap_to_module(node, "mul" if mul else "add", module, (a, b))] = out_qp


def _lower_join(low: _Lowering, node: fx.Node) -> None:
    values = join_inputs(node)
    dim = join_dim(node)
    node, out_qp = _absorb_observer(low, node)
    module = QuantizedCat([low.qparams[v] for v in values], out_qp, dim=dim, backend=low.backend)
    low.qparams[low.swap_to_module(node, "cat", module, (values,))] = out_qp


def _lower_value(low: _Lowering, node: fx.Node, qp: QParams) -> None:
    spec = pool_options(node, low.modules)
    if spec is None:  # a ReLU
        new = low.swap_to_module(node, "relu", QuantizedReLU(qp, low.backend), (tensor_input(node),))
    else:
        kind, dim, options = spec
        module = QuantizedPool(qp, low.backend, kind=kind, dim=dim, options=options)
        new = low.swap_to_module(node, f"{kind}_pool", module, (tensor_input(node),))
    low.qparams[new] = qp


def fixed_output_qparams(node: fx.Node, modules: dict[str, nn.Module], backend: Backend) -> QParams:
    """The output qparams of an int8 sigmoid/hardsigmoid/tanh node: its range on the backend's integer range."""
    function = fixed_function(node, modules)
    assert function is not None
    return fixed_qparams(function, backend.activation_qrange(feeds_grouped_conv=_feeds_grouped_conv(node, modules)))


def _lower_fixed(low: _Lowering, node: fx.Node, qa: QParams) -> None:
    qout = fixed_output_qparams(node, low.modules, low.backend)
    module = QuantizedFixedRange(str(fixed_function(node, low.modules)), qa, qout, low.backend)
    low.qparams[low.swap_to_module(node, module.function, module, (tensor_input(node),))] = qout


def _dequantize_inputs(low: _Lowering, node: fx.Node) -> None:
    for value in list(node.all_input_nodes):
        if value not in low.qparams:
            continue
        if value not in low.dequantized:
            name = low.add_module("dequantize", DeQuantize(low.qparams[value], low.backend))
            with low.gm.graph.inserting_after(value):
                low.dequantized[value] = low.gm.graph.call_module(name, (value,))
        node.replace_input_with(value, low.dequantized[value])


def _wants_int8(node: fx.Node) -> bool:
    """A layer the config keeps float may still be followed by an observer: the next layer's input observer."""
    settings = node.meta.get(LAYER_SETTINGS)
    return settings is None or bool(settings.quantize)


def _lower_node(low: _Lowering, node: fx.Node) -> None:
    kind = classify(node, low.modules)
    source = tensor_input(node)
    observed = _observer(low, only_user(node)) is not None
    if _observer(low, node) is not None:  # an observer no producer absorbed: a float value entering int8
        qp = _output_qparams(low, node)
        low.qparams[low.swap_to_module(node, "quantize", Quantize(qp, low.backend), (source,))] = qp
    elif kind is OpKind.COMPUTE and observed and source in low.qparams and _wants_int8(node):
        _lower_compute(low, node)
    elif kind is OpKind.BINARY and observed and all(a in low.qparams for a in node.args[:2]):
        _lower_binary(low, node)
    elif kind is OpKind.JOIN and observed and all(v in low.qparams for v in join_inputs(node)):
        _lower_join(low, node)
    elif kind is OpKind.STRUCTURAL and node.op == "call_module" and isinstance(
            low.modules[str(node.target)], _DROPPED):
        node.replace_all_uses_with(source)  # type: ignore[arg-type]
        low.gm.graph.erase_node(node)
    elif kind is OpKind.VALUE and source in low.qparams:
        _lower_value(low, node, low.qparams[source])
    elif kind is OpKind.FIXED and source in low.qparams:
        _lower_fixed(low, node, low.qparams[source])
    elif kind is OpKind.STRUCTURAL and source in low.qparams:
        low.qparams[node] = low.qparams[source]
    elif kind is not OpKind.META:
        _dequantize_inputs(low, node)


def _view_to_reshape(node: fx.Node) -> None:
    """``x.view(shape)`` -> ``x.reshape(shape)``: the fbgemm, qnnpack and oneDNN convs return channels-last tensors
    (still so after a dequantize) where the float model had contiguous ones; ``view`` refuses them (the common
    ``x.view(x.size(0), -1)`` after a conv crashed), ``reshape`` copies only then."""
    if node.op == "call_method" and node.target == "view" and not any(
            isinstance(arg, torch.dtype) for arg in (*node.args[1:], *node.kwargs.values())):
        node.target = "reshape"


def lower_to_int8(gm: fx.GraphModule, config: QuantConfig, backend: Backend) -> fx.GraphModule:
    """Rewrite a calibrated prepared graph (in place) into an INT8 graph running on ``backend``."""
    low = _Lowering(gm, config, backend, modules_of(gm), observer_qparams(gm, backend))
    for node in nodes_of(gm):
        if not getattr(node, "_erased", False):  # observers absorbed by their producer are already gone
            _view_to_reshape(node)
            _lower_node(low, node)
    return finish(fuse_lowered(gm))

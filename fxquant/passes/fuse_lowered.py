"""Fusions on the lowered INT8 graph, where the backend has a kernel for the pair (and only there).

* ``fuse_conv_add``: ResNet/MobileNet blocks end in ``add(conv(x), identity)``, an int8 round trip of the conv output
  plus an element-wise add. oneDNN's conv takes the other addend as a ``sum`` post-op and rounds once, as torch.ao's
  ``conv2d_add`` and Inductor's ``qconv2d_pointwise.binary`` do: one
  :class:`~fxquant.nn.quantized.QuantizedConvAdd2d` call at the add's place (``Backend.fuses_conv_add``).
* ``fuse_float_outputs``: a Linear/Conv whose only user is a dequantize (BERT's q/k/v projections, the GELU input)
  returns its float result directly (``Backend.fuses_float_output``), as Inductor does: no uint8 write, no
  dequantize.
* ``fuse_unary``: such a float result whose only user is SiLU, hardswish or GELU, itself quantized right after
  (EfficientNet's conv + SiLU, BERT's intermediate Linear + GELU), becomes one call with the function as the
  kernel's post-op and the quantize's qparams as its output (``Backend.fused_linear_unary``), as Inductor's
  ``qconv2d_pointwise`` / ``qlinear_pointwise`` unary fusions do: no float tensor, no separate quantize.

* ``fuse_lookup``: what is left of ``quantize(f(dequantize(a)))`` with ``f`` an element-wise activation (SiLU,
  hardswish, GELU, ... on fbgemm/qnnpack, which fuse none of them) becomes one
  :class:`~fxquant.nn.lookup.QuantizedLookup`: a 256-entry table of the three ops' results, one byte pass.

fbgemm/qnnpack have none of the first three kernels and keep the separate ops. The passes edit in place; the caller
runs dead-code elimination and recompiles.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import fx, nn

from fxquant.nn.lookup import QuantizedLookup, elementwise_function
from fxquant.nn.quantized import (
    DeQuantize,
    Quantize,
    QuantizedAdd,
    QuantizedConv1d,
    QuantizedConv2d,
    QuantizedConv3d,
    QuantizedConvAdd2d,
    QuantizedConvNd,
    QuantizedLinear,
    _BackendModule,
)
from fxquant.passes._graph import nodes_of, replace_submodule
from fxquant.passes.patterns import OpKind, classify


def _module(gm: fx.GraphModule, node: fx.Node) -> object:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def _fusable_conv(gm: fx.GraphModule, add_node: fx.Node, add: QuantizedAdd) -> int | None:
    """The position (0 or 1) of an add input that a plain Conv2d on the add's backend computes for the add alone."""
    if add_node.args[0] is add_node.args[1]:
        return None
    for index, value in enumerate(add_node.args[:2]):
        if not isinstance(value, fx.Node) or len(value.users) != 1:
            continue
        conv = _module(gm, value)
        if isinstance(conv, QuantizedConv2d) and type(conv) is QuantizedConv2d and not conv.relu \
                and not conv.range_clamp and conv.backend is add.backend:
            return index
    return None


def _read_later(gm: fx.GraphModule, accum: fx.Node, add_node: fx.Node, conv_node: fx.Node) -> bool:
    """Whether ``accum``'s tensor may be read after the fused kernel starts writing into it: by the fused conv
    itself (``x + conv(x)``), or by anything after the add.

    Safe only when a backend module made it (a fresh tensor, not a view of something else) and every other reader
    is a backend module or a metadata read that runs before the add: a view taken earlier could be read later.
    """
    if not isinstance(_module(gm, accum), _BackendModule) or conv_node.args[0] is accum:
        return True
    modules = dict(gm.named_modules())
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for user in accum.users:
        if user is add_node:
            continue
        harmless = isinstance(_module(gm, user), _BackendModule) or classify(user, modules) is OpKind.META
        if not harmless or position[user] > position[add_node]:
            return True
    return False


def fuse_conv_add(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``add(conv(x), other)`` by one conv+add call where the add's backend fuses them."""
    for node in nodes_of(gm):
        add = _module(gm, node)
        if not isinstance(add, QuantizedAdd) or not add.backend.fuses_conv_add:
            continue
        index = _fusable_conv(gm, node, add)
        if index is None:
            continue
        conv_node, accum = node.args[index], node.args[1 - index]
        assert isinstance(conv_node, fx.Node) and isinstance(accum, fx.Node)
        conv = gm.get_submodule(str(conv_node.target))
        assert isinstance(conv, QuantizedConv2d)
        accum_qp = add.qb if index == 0 else add.qa
        fused = QuantizedConvAdd2d(conv, (accum_qp, add.out_qp), relu=add.relu,
                                   clone_accum=_read_later(gm, accum, node, conv_node))
        replace_submodule(gm, str(conv_node.target), fused)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(str(conv_node.target), (conv_node.args[0], accum))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        gm.graph.erase_node(conv_node)
    return gm


def fuse_float_outputs(gm: fx.GraphModule) -> fx.GraphModule:
    """Let a Linear/Conv whose only user is a dequantize return float itself, where its backend fuses that."""
    for node in nodes_of(gm):
        linear = _module(gm, node)
        if type(linear) not in _FLOAT_OUTPUT or len(node.users) != 1:
            continue
        assert isinstance(linear, (QuantizedLinear, QuantizedConvNd))
        backend = linear.backend
        fuses = backend.fuses_float_output if isinstance(linear, QuantizedLinear) else backend.fuses_float_conv_output
        if not fuses or linear.range_clamp:
            continue
        user = next(iter(node.users))
        if isinstance(_module(gm, user), DeQuantize):
            linear.float_output = True
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)
    return gm


_FLOAT_OUTPUT = (QuantizedLinear, QuantizedConv1d, QuantizedConv2d, QuantizedConv3d)  # exact types: not ConvAdd2d
_UNARY_MODULES: dict[type, str] = {nn.SiLU: "silu", nn.Hardswish: "hardswish"}
_UNARY_FUNCTIONS: dict[object, str] = {F.silu: "silu", F.hardswish: "hardswish"}


def _unary_name(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The ``UNARY_FUNCTIONS`` name of a float SiLU/hardswish/GELU node applied to its first argument, if it is one."""
    module = _module(gm, node)
    if isinstance(module, nn.GELU):
        return "gelu" if module.approximate == "none" else "gelu_tanh"
    if module is not None:
        return _UNARY_MODULES.get(type(module))
    if node.op != "call_function":
        return None
    if node.target is F.gelu and len(node.args) == 1:
        return "gelu" if node.kwargs.get("approximate", "none") == "none" else "gelu_tanh"
    return _UNARY_FUNCTIONS.get(node.target) if len(node.args) == 1 else None


def _quantized_chain(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, object, fx.Node, Quantize] | None:
    """For ``quantize(node(source))`` where ``source`` and ``node`` each have that one reader: ``source``, its
    module (None for a function), the quantize node and module; else None."""
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node) or len(source.users) != 1 or len(node.users) != 1:
        return None
    quantize_node = next(iter(node.users))
    quantize = _module(gm, quantize_node)
    return (source, _module(gm, source), quantize_node, quantize) if isinstance(quantize, Quantize) else None


def fuse_unary(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold ``quantize(f(layer(x)))`` into the layer where its backend applies ``f`` inside the kernel."""
    for node in nodes_of(gm):
        unary = _unary_name(gm, node)
        chain = _quantized_chain(gm, node) if unary is not None else None
        if unary is None or chain is None:
            continue
        source, layer, quantize_node, quantize = chain
        if type(layer) not in _FLOAT_OUTPUT:
            continue
        assert isinstance(layer, (QuantizedLinear, QuantizedConvNd))
        fused = layer.backend.fused_linear_unary if isinstance(layer, QuantizedLinear) else \
            layer.backend.fused_conv_unary
        if not layer.float_output or layer.relu or unary not in fused or quantize.backend is not layer.backend:
            continue
        layer.unary, layer.unary_qp, layer.float_output = unary, quantize.qp, False
        quantize_node.replace_all_uses_with(source)
        gm.graph.erase_node(quantize_node)
        gm.graph.erase_node(node)
    return gm


def _free_name(gm: fx.GraphModule, name: str) -> str:
    candidate, count = name, 0
    while hasattr(gm, candidate):
        count += 1
        candidate = f"{name}_{count}"
    return candidate


def fuse_lookup(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``quantize(f(dequantize(a)))``, one backend throughout and ``f`` element-wise, by a table lookup."""
    modules = dict(gm.named_modules())
    for node in nodes_of(gm):
        function = elementwise_function(node, modules)
        chain = _quantized_chain(gm, node) if function is not None else None
        if function is None or chain is None:
            continue
        source, dequantize, quantize_node, quantize = chain
        if not isinstance(dequantize, DeQuantize) or dequantize.backend is not quantize.backend \
                or dequantize.qp.per_channel or quantize.qp.per_channel:
            continue
        name = _free_name(gm, f"lookup_{node.name}")
        gm.add_submodule(name, QuantizedLookup(function, dequantize.qp, quantize.qp, quantize.backend))
        with gm.graph.inserting_before(quantize_node):
            lookup = gm.graph.call_module(name, source.args)
        quantize_node.replace_all_uses_with(lookup)
        for erased in (quantize_node, node, source):
            gm.graph.erase_node(erased)
    return gm


def fuse_lowered(gm: fx.GraphModule) -> fx.GraphModule:
    """Every fusion above, in place."""
    return fuse_lookup(fuse_unary(fuse_float_outputs(fuse_conv_add(gm))))

"""Rewrite traced matmul-softmax-matmul attention into ``F.scaled_dot_product_attention``.

A hand-written attention traces as ``matmul(softmax(matmul(q, k.transpose(-2, -1)) * scale [+ mask]), v)``: two
batched matmuls, a transposed copy of ``k``, a scaled and a softmaxed score tensor, each a full pass over
``batch x heads x seq x seq`` floats. torch's fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``,
what PT2E + Inductor call through their attention pattern matcher) computes the same function in one blocked pass,
the same values within float rounding (docs/backends.md, "hand-written attention", has the measurement). The
attention's matmuls are float in fxquant's INT8 models, so this is a float rewrite: it makes the prepared
(calibration) forward and the converted model faster, and changes no observer or qparam.

Recognised, for every node that is used only by the next step (so nothing else reads the scores or probabilities):
``matmul(q, kt)`` with ``kt`` a transpose/permute of ``k``'s last two dims (only read there), optionally times a
number or divided by one, optionally plus an additive mask, ``softmax(dim=-1)``, optionally an eval-mode dropout,
then ``matmul(probs, v)``. Anything else (a boolean ``masked_fill`` mask, softmax over another dim, probabilities
returned to the caller) is left as written.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.passes._graph import finish, modules_of, nodes_of, only_user

_MATMULS = (torch.matmul, operator.matmul)
_SOFTMAXES = (torch.softmax, F.softmax)


def _is_matmul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS) or (
        node.op == "call_method" and node.target == "matmul")


def _transposed_source(node: fx.Node) -> fx.Node | None:
    """``k`` when ``node`` swaps the last two dims of ``k`` (``transpose(-2, -1)``, or ``permute(0, 1, 3, 2)``)."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source, rest = node.args[0], tuple(node.args[1:])
    if node.target in ("transpose", torch.transpose) and set(rest) in ({-1, -2},):
        return source
    if node.target == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        if len(dims) == 4 and tuple(dims) == (0, 1, 3, 2):
            return source
    return None


def _softmax_input(node: fx.Node, modules: Mapping[str, nn.Module]) -> fx.Node | None:
    """The scores a last-dim softmax reads."""
    dim: Any
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    if isinstance(module, nn.Softmax):
        dim = module.dim
    elif (node.op == "call_function" and node.target in _SOFTMAXES) or (
            node.op == "call_method" and node.target == "softmax"):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if node.kwargs.get("dtype") is not None or len(node.args) > 2:
            return None
    else:
        return None
    source = node.args[0]
    return source if dim == -1 and isinstance(source, fx.Node) else None


def _unscaled(node: fx.Node) -> tuple[fx.Node, float]:
    """``(scores, scale)`` for ``scores * c`` or ``scores / c`` with a number ``c``; ``(node, 1.0)`` otherwise."""
    if node.op == "call_function" and len(node.args) == 2 and not node.kwargs:
        left, right = node.args
        number = (int, float)
        if node.target in (operator.mul, torch.mul):
            if isinstance(left, fx.Node) and isinstance(right, number):
                return left, float(right)
            if isinstance(right, fx.Node) and isinstance(left, number):
                return right, float(left)
        if node.target in (operator.truediv, torch.div) and isinstance(left, fx.Node) and isinstance(right, number) \
                and right != 0:
            return left, 1.0 / float(right)
    return node, 1.0


def _is_eval_dropout(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    if node.op == "call_module":
        module = modules.get(str(node.target))
        return isinstance(module, nn.Dropout) and not module.training
    return node.op == "call_function" and node.target is F.dropout and node.kwargs.get("training") is False


def _attention(out: fx.Node, modules: Mapping[str, nn.Module]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """SDPA's ``(q, k, v)`` and keyword arguments when ``out = matmul(probs, v)`` closes an attention pattern."""
    if not _is_matmul(out) or len(out.args) != 2 or not all(isinstance(a, fx.Node) for a in out.args):
        return None
    probs, v = out.args
    assert isinstance(probs, fx.Node)
    if _is_eval_dropout(probs, modules) and only_user(probs) is out:
        out, dropped = probs, probs.args[0]
        if not isinstance(dropped, fx.Node):
            return None
        probs = dropped
    if only_user(probs) is not out:
        return None
    scores = _softmax_input(probs, modules)
    if scores is None or only_user(scores) is not probs:
        return None
    for unmasked, mask in _mask_splits(scores):
        product, scale = _unscaled(unmasked)
        if product is not unmasked and only_user(product) is not unmasked:
            continue
        if unmasked is not scores and only_user(unmasked) is not scores:
            continue
        if not _is_matmul(product) or len(product.args) != 2:
            continue
        q, kt = product.args
        k = _transposed_source(kt) if isinstance(kt, fx.Node) and only_user(kt) is product else None
        if k is not None and isinstance(q, fx.Node) and isinstance(v, fx.Node) and _shapes_fit(q, k, v, mask):
            return (q, k, v), {"attn_mask": mask, "scale": scale}
    return None


def _shapes_fit(q: fx.Node, k: fx.Node, v: fx.Node, mask: Any) -> bool:
    """Whether the example run recorded shapes SDPA takes as they are: same float dtype and leading dims (no
    broadcasting of heads), ``k`` as wide as ``q``, as long as ``v``, and a float (additive) mask if any: a boolean
    mask means "keep" to SDPA but adds 0/1 here. Without recorded shapes (``tensor_meta``) nothing is rewritten."""
    metas: list[Any] = [node.meta.get("tensor_meta") for node in (q, k, v)]
    if any(meta is None or not hasattr(meta, "shape") for meta in metas):
        return False
    (q_shape, k_shape, v_shape), dtypes = [tuple(m.shape) for m in metas], {m.dtype for m in metas}
    if mask is not None:
        mask_meta = mask.meta.get("tensor_meta") if isinstance(mask, fx.Node) else None
        if mask_meta is None or not getattr(mask_meta, "dtype", torch.bool).is_floating_point:
            return False
        dtypes.add(mask_meta.dtype)
    return (len(dtypes) == 1 and next(iter(dtypes)).is_floating_point and len(q_shape) >= 3
            and q_shape[:-2] == k_shape[:-2] == v_shape[:-2] and q_shape[-1] == k_shape[-1]
            and k_shape[-2] == v_shape[-2])


def _mask_splits(scores: fx.Node) -> list[tuple[fx.Node, Any]]:
    """``(unmasked scores, additive mask)`` readings of ``scores``: ``(scores, None)``, and both orders of an add."""
    splits: list[tuple[fx.Node, Any]] = [(scores, None)]
    if scores.op == "call_function" and scores.target in (operator.add, torch.add) and len(scores.args) == 2 \
            and not scores.kwargs:
        left, right = scores.args
        splits += [(a, b) for a, b in ((left, right), (right, left))
                   if isinstance(a, fx.Node) and isinstance(b, fx.Node)]
    return splits


def fuse_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every recognised attention pattern by one ``F.scaled_dot_product_attention`` call, in place."""
    modules = modules_of(gm)
    changed = False
    for node in reversed(nodes_of(gm)):  # from the output matmul backwards; replaced nodes go at ``finish``
        match = _attention(node, modules)
        if match is None:
            continue
        args, kwargs = match
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(F.scaled_dot_product_attention, args, kwargs)
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        changed = True
    return finish(gm) if changed else gm

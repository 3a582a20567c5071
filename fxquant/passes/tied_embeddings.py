"""Tied input embeddings read their INT8 head's weight (convert's last pass, :mod:`fxquant.nn.tied_embedding`).

A language model with ``tie_word_embeddings`` computes its logits with the input embedding's matrix. When convert
makes that head an INT8 Linear, the float matrix would stay alive through the embedding alone: a float copy of a
quantized weight. :func:`share_tied_embeddings` gives such an embedding the head's int8 rows instead
(:class:`~fxquant.nn.tied_embedding.TiedInt8Embedding`).

The tie is found in the prepared model (:func:`tied_heads`: an ``nn.Embedding`` and a Linear holding the very same
tensor), because SmoothQuant gives a tied head a weight of its own, ``W * s`` per input column, before lowering.
:func:`head_column_scales` reads ``s`` off the two float matrices just before lowering. The head's rows are then
``W`` again where the ``1 / s`` became the head's ``input_scale`` (``weight_rows`` applies it), and the embedding
multiplies them by ``1 / s`` itself where the ``1 / s`` went elsewhere (into the norm before the head, or a static
head's input). An embedding matched by ``convert(keep_float=...)``, one with ``max_norm`` or sparse gradients, one
whose head stayed float, and one whose head's weight is not its matrix column-scaled stay float.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Collection, Mapping
from typing import TypeGuard

import torch
from torch import nn

from fxquant.nn.fused import Fused
from fxquant.nn.quantized import QuantizedLinear
from fxquant.nn.schemes import SchemeLinear
from fxquant.nn.tied_embedding import Int8Rows, TiedInt8Embedding
from fxquant.passes._graph import replace_submodule

log = logging.getLogger(__name__)
_Key = tuple[int, int, tuple[int, ...], tuple[int, ...]]
_RTOL = 1e-5  # W * s against the head's float weight: a float32 product and quotient, a few ulps apart


def _tensor_key(tensor: torch.Tensor) -> _Key:
    """Where ``tensor`` lies: two modules hold the same tensor (a tie) when their weights' keys are equal."""
    storage = tensor.untyped_storage().data_ptr()
    return storage, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride())


def _plain(module: nn.Module) -> TypeGuard[nn.Embedding]:
    return type(module) is nn.Embedding and module.max_norm is None and not module.sparse


def tied_heads(model: nn.Module) -> dict[str, str]:
    """Path of each plain ``nn.Embedding`` of ``model`` -> path of a Linear whose weight is the same tensor."""
    linears: dict[_Key, str] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.device.type != "meta":
            linears.setdefault(_tensor_key(module.weight), path)
    return {path: linears[key] for path, module in model.named_modules()
            if _plain(module) and (key := _tensor_key(module.weight)) in linears}


def _column_factors(embedding: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``s`` with ``weight == embedding * s`` (one factor per column, to float32 rounding), or None if none fits."""
    if embedding.shape != weight.shape:
        return None
    columns = torch.arange(embedding.shape[1])
    rows = embedding.abs().argmax(dim=0)  # each column's largest entry: its quotient is the best-conditioned
    pivots = embedding[rows, columns]
    factors = torch.where(pivots == 0, torch.ones_like(pivots), weight[rows, columns] / pivots)
    return factors if torch.allclose(embedding * factors, weight, rtol=_RTOL, atol=0.0) else None


@torch.no_grad()
def head_column_scales(model: nn.Module, tied: Mapping[str, str]) -> dict[str, torch.Tensor | None]:
    """For each embedding of ``tied`` whose head in ``model`` (the float model convert lowers) computes with its
    matrix: None where the head still holds the embedding's tensor, ``s`` where the head's weight is the matrix
    times ``s`` per column (SmoothQuant); embeddings whose head holds anything else are left out."""
    scales: dict[str, torch.Tensor | None] = {}
    modules = dict(model.named_modules())
    for path, head_path in tied.items():
        embedding, head = modules.get(path), modules.get(head_path)
        if not (embedding is not None and _plain(embedding) and isinstance(head, nn.Linear)):
            continue
        if _tensor_key(head.weight) == _tensor_key(embedding.weight):
            scales[path] = None
        elif (factors := _column_factors(embedding.weight.detach(), head.weight.detach())) is not None:
            scales[path] = factors
    return scales


def _lowered_head(model: nn.Module, path: str) -> Int8Rows | None:
    """The INT8 Linear that replaced the Linear at ``path``: there, inside a fused module there, or at the parent
    path (an island of one Linear, unwrapped: :func:`~fxquant.passes.schemes.unwrap_layer_islands`)."""
    for where in (path, path.rpartition(".")[0]):
        try:
            module = model.get_submodule(where)
        except AttributeError:
            continue
        module = module.inner if isinstance(module, Fused) else module
        if isinstance(module, (SchemeLinear, QuantizedLinear)):
            return module
        if where == path:  # the Linear is still there: kept float
            return None
    return None


def share_tied_embeddings(model: nn.Module, tied: Mapping[str, str], scales: Mapping[str, torch.Tensor | None], *,
                          keep_float: Collection[str] = (), prefix: str = "") -> list[str]:
    """Replace each embedding of ``tied`` (from :func:`tied_heads` on the prepared model) that has ``scales`` (from
    :func:`head_column_scales` before lowering) and whose head became an INT8 Linear by a
    :class:`TiedInt8Embedding` of that head (in place). ``keep_float``: convert's patterns, matched against paths
    without ``prefix``. Returns the paths replaced (without ``prefix``)."""
    shared = []
    for path, head_path in tied.items():
        head = _lowered_head(model, head_path)
        if head is None:
            continue
        if path not in scales:  # an INT8 head whose weight is not the matrix column-scaled: nothing to read rows of
            log.info("fxquant: %s stays float: its tied head %s computes with another weight",
                     path.removeprefix(prefix), head_path.removeprefix(prefix))
            continue
        embedding = model.get_submodule(path)
        assert isinstance(embedding, nn.Embedding)
        # every path the module sits at (T5's ``shared`` is also each stack's ``embed_tokens``)
        paths = [where for where, module in model.named_modules(remove_duplicate=False) if module is embedding]
        user_paths = [where.removeprefix(prefix) for where in paths]
        if any(fnmatch.fnmatchcase(where, pattern) for where in user_paths for pattern in keep_float):
            continue
        s = scales[path]
        inside = isinstance(head, SchemeLinear) and head.input_scale is not None  # the head's rows are W already
        tied_embedding = TiedInt8Embedding(embedding, head, None if s is None or inside else 1.0 / s)
        for where in paths:
            replace_submodule(model, where, tied_embedding)
        shared += user_paths
    if shared:
        log.info("fxquant: %s read(s) the int8 rows of the tied head", ", ".join(shared))
    return shared

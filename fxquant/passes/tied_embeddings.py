"""Tied input embeddings read their INT8 head's weight (convert's last pass, :mod:`fxquant.nn.tied_embedding`).

A language model with ``tie_word_embeddings`` computes its logits with the input embedding's matrix. When convert
makes that head an INT8 scheme Linear, the float matrix would stay alive through the embedding alone: a float copy
of a quantized weight. :func:`share_tied_embeddings` gives such an embedding the head's int8 rows instead
(:class:`~fxquant.nn.tied_embedding.TiedInt8Embedding`).

The tie is found in the prepared model (:func:`tied_heads`: an ``nn.Embedding`` and a Linear holding the very same
tensor), because SmoothQuant gives a tied head a weight of its own (``W * s``) before lowering. Such a head still
computes with ``W`` when the ``1 / s`` in front of it went into its ``input_scale``
(:meth:`~fxquant.nn.schemes.SchemeLinear.weight_rows` applies it); where it went into the head's producer instead,
the head's rows are not the embedding's vectors and the embedding stays float. So does an embedding matched by
``convert(keep_float=...)``, one with ``max_norm`` or sparse gradients, and one whose head stayed float or static.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Collection
from typing import TypeGuard

import torch
from torch import nn

from fxquant.nn.fused import Fused
from fxquant.nn.schemes import SchemeLinear
from fxquant.nn.tied_embedding import TiedInt8Embedding
from fxquant.passes._graph import replace_submodule

log = logging.getLogger(__name__)


_Key = tuple[int, int, tuple[int, ...], tuple[int, ...]]


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


def _lowered_head(model: nn.Module, path: str) -> SchemeLinear | None:
    """The scheme Linear that replaced the Linear at ``path``: there, inside a fused module there, or at the parent
    path (an island of one Linear, unwrapped: :func:`~fxquant.passes.schemes.unwrap_layer_islands`)."""
    for where in (path, path.rpartition(".")[0]):
        try:
            module = model.get_submodule(where)
        except AttributeError:
            continue
        module = module.inner if isinstance(module, Fused) else module
        if isinstance(module, SchemeLinear):
            return module
        if where == path:  # the Linear is still there (kept float, or static): not a scheme Linear
            return None
    return None


def share_tied_embeddings(model: nn.Module, tied: dict[str, str], unsmoothed: Collection[str], *,
                          keep_float: Collection[str] = (), prefix: str = "") -> list[str]:
    """Replace each embedding of ``tied`` (from :func:`tied_heads` on the prepared model) whose head became a scheme
    Linear computing with the embedding's matrix by a :class:`TiedInt8Embedding` of that head (in place).

    ``unsmoothed``: the embeddings still tied just before lowering (:func:`tied_heads` on the model convert
    lowers); ``keep_float``: convert's patterns, matched against paths without ``prefix``. Returns the paths
    replaced (without ``prefix``)."""
    shared = []
    for path, head_path in tied.items():
        user_path = path.removeprefix(prefix)
        embedding = model.get_submodule(path)
        head = _lowered_head(model, head_path)
        if head is None or not _plain(embedding) or any(fnmatch.fnmatchcase(user_path, p) for p in keep_float):
            continue
        if path not in unsmoothed and head.input_scale is None:
            log.info("fxquant: %s stays float: its tied head %s was smoothed with the 1/s folded into its producer",
                     user_path, head_path.removeprefix(prefix))
            continue
        replace_submodule(model, path, TiedInt8Embedding(embedding, head))
        shared.append(user_path)
    return shared

"""An input embedding that reads its vectors from the INT8 output layer it is tied to.

A language model whose ``lm_head`` shares its weight with the input embedding (``tie_word_embeddings``: SmolLM2,
GPT-2, Gemma, ...) holds that matrix once. Once ``lm_head`` is INT8 the float matrix is still there, kept alive by
the embedding alone: a float copy of a quantized weight, on SmolLM2 nearly as many bytes as all its INT8 weights.
:class:`TiedInt8Embedding` takes the embedding's place and looks its rows up in the head's int8 weight
(``weight_rows``): the vectors the head computes with, each row on its own int8 grid, and one copy of the matrix
again, as in the float model.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Int8Rows(Protocol):
    """An INT8 Linear whose float weight can be read a few rows at a time: the scheme Linears
    (:class:`~fxquant.nn.schemes.SchemeLinear`) and the static one (:class:`~fxquant.nn.quantized.QuantizedLinear`)."""

    scheme: str

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    def weight_rows(self, outputs: torch.Tensor) -> torch.Tensor: ...

    def dequantized_weight(self) -> torch.Tensor: ...


class TiedInt8Embedding(nn.Embedding):
    """``nn.Embedding`` whose vectors are ``head``'s dequantized weight rows, row ``i`` read from ``head`` when token
    ``i`` is looked up, times ``column_scale`` per dimension where given (SmoothQuant gave the head ``W * s`` and
    put ``1 / s`` in front of it, outside the head: the embedding multiplies its rows by ``1 / s``).

    ``head`` is not a submodule (it stays at its own path, once in ``state_dict`` and ``named_modules``); the module
    keeps only ``column_scale``, a non-persistent buffer. It is still an ``nn.Embedding``, so code that asks for one
    (``get_input_embeddings()``) finds it; forward takes what ``nn.Embedding`` takes and returns float32 vectors.
    Training options (``max_norm``, sparse gradients) are not supported: convert leaves such an embedding float."""

    head: Int8Rows
    column_scale: torch.Tensor | None

    def __init__(self, embedding: nn.Embedding, head: Int8Rows, column_scale: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: no weight Parameter
        if (head.out_features, head.in_features) != (embedding.num_embeddings, embedding.embedding_dim):
            raise ValueError(f"TiedInt8Embedding: a {head.out_features}x{head.in_features} head for a "
                             f"{embedding.num_embeddings}x{embedding.embedding_dim} embedding")
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.max_norm, self.norm_type = None, embedding.norm_type
        self.scale_grad_by_freq, self.sparse = False, False
        self.__dict__["head"] = head  # a plain attribute, not a submodule
        self.register_buffer("column_scale", None if column_scale is None else column_scale.float().clone(),
                             persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The float matrix of every vector (made on access, from ``head``; none is kept)."""
        weight = self.head.dequantized_weight()
        return weight if self.column_scale is None else weight * self.column_scale

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = self.head.weight_rows(input)  # an id outside [0, num_embeddings) raises IndexError, as nn.Embedding
        return rows if self.column_scale is None else rows.mul_(self.column_scale)

    def extra_repr(self) -> str:
        scaled = "" if self.column_scale is None else ", times 1/s per dimension"
        return f"{super().extra_repr()}, int8 rows of the tied {self.head.scheme} head{scaled}"

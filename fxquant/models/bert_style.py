"""``bert_style_encoder``: a post-LayerNorm BERT encoder from plain modules, the zoo's transformer workload.

Built only from nn.Embedding / nn.Linear / nn.LayerNorm / nn.GELU and a softmax, with head splitting done by
``unflatten``/``flatten`` on constant sizes, so ``torch.fx.symbolic_trace`` sees no shape-dependent Python and the
traced graph accepts any sequence length up to ``seq_len``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fxquant.errors import ConfigError
from fxquant.models._blocks import check_positive, seeded_generator

SEQ_LEN = 128
INPUT_SHAPE = (SEQ_LEN,)  # token ids, int64
VOCAB = 1000


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention with separate q/k/v projections (what Linear quantization sees)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, hidden) -> (batch, heads, seq, head_dim) without reading the batch or sequence size.
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split_heads(self.query(x)), self._split_heads(self.key(x)), self._split_heads(self.value(x))
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.scale, dim=-1)
        context = torch.matmul(probs, v).transpose(1, 2).flatten(-2)
        return self.output(context)


class EncoderLayer(nn.Module):
    """Attention and a GELU feed-forward, each wrapped in residual + LayerNorm (post-LN, as in BERT)."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.gelu = nn.GELU()
        self.ffn_output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x))
        return self.output_norm(x + self.ffn_output(self.gelu(self.intermediate(x))))


class BertStyleEncoder(nn.Module):
    """Token + position embeddings, LayerNorm, then ``layers`` encoder layers; returns the last hidden states."""

    position_ids: torch.Tensor

    def __init__(self, hidden: int, layers: int, heads: int, intermediate: int, seq_len: int, vocab: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq_len, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.register_buffer("position_ids", torch.arange(seq_len).unsqueeze(0), persistent=False)
        self.layers = nn.Sequential(*(EncoderLayer(hidden, heads, intermediate) for _ in range(layers)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Under fx ``size(1)`` is a graph node, so the traced model follows the real length. ``narrow`` rather than
        # ``buffer[:, :n]``: a plain tensor cannot be sliced by a traced value.
        positions = torch.narrow(self.position_ids, 1, 0, input_ids.size(1))
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.layers(self.embedding_norm(x))


def bert_style_encoder(
    *,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 1024,
    seq_len: int = SEQ_LEN,
    vocab: int = VOCAB,
) -> BertStyleEncoder:
    """A random-init BERT-style encoder in eval mode: (batch, seq) int64 token ids -> (batch, seq, hidden) states.

    >>> bert_style_encoder(layers=1)(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 256])
    """
    check_positive(
        "bert_style_encoder",
        hidden=hidden,
        layers=layers,
        heads=heads,
        intermediate=intermediate,
        seq_len=seq_len,
        vocab=vocab,
    )
    if hidden % heads:
        raise ConfigError(f"bert_style_encoder: hidden={hidden} must be divisible by heads={heads}")
    model = BertStyleEncoder(hidden, layers, heads, intermediate, seq_len, vocab)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)  # BERT's initializer_range
    return model.eval()


def example_inputs(
    batch_size: int = 1, *, seq_len: int = SEQ_LEN, vocab: int = VOCAB, seed: int = 0
) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch_size, seq_len), generator=seeded_generator(seed)),)

"""The transformers models of ``bench_hf.py``: built from configs with random weights (seed 0, no download).

Each row has its model at realistic dimensions but fewer layers (every layer of these models is the same, so
latency ratios and SQNR per layer carry over; the absolute milliseconds scale with the layer count), and tiny
dimensions for ``--quick``. The timed inputs use seed 0, calibration batches seeds 1..n of the same shape, so
calibration never sees the measured tensors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Inputs = tuple[Any, ...]
MakeInputs = Callable[[torch.Generator], Inputs]


@dataclass(frozen=True)
class HfCase:
    """One row: the float model, its timed inputs, calibration batches, and how to read its main output."""

    name: str
    dims: str  # what the model is, for the table
    model: nn.Module
    inputs: Inputs
    calibration: tuple[Inputs, ...]
    output: Callable[[Any], torch.Tensor]  # the main output tensor of one call's result


@dataclass(frozen=True)
class Spec:
    dims: str
    model: nn.Module
    make_inputs: MakeInputs
    output: Callable[[Any], torch.Tensor]


def _hidden(result: Any) -> torch.Tensor:
    return result.last_hidden_state


def _logits(result: Any) -> torch.Tensor:
    return result.logits


def _tokens(vocab: int, batch: int, length: int, *, mask: bool) -> MakeInputs:
    def make(g: torch.Generator) -> Inputs:
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        return (ids, torch.ones(batch, length, dtype=torch.long)) if mask else (ids,)
    return make


def bert(quick: bool) -> Spec:
    import transformers

    hidden, heads, ffn, layers, batch, length = (64, 4, 256, 2, 2, 16) if quick else (768, 12, 3072, 4, 8, 128)
    config = transformers.BertConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
                                     num_hidden_layers=layers)
    dims = f"BertModel h{hidden}/{heads}h/ffn{ffn}, {layers} of 12 layers; ids+mask {batch}x{length}"
    return Spec(dims, transformers.BertModel(config), _tokens(config.vocab_size, batch, length, mask=True), _hidden)


def vit(quick: bool) -> Spec:
    import transformers

    hidden, heads, ffn, layers, size, batch = (64, 4, 256, 2, 32, 2) if quick else (768, 12, 3072, 4, 224, 8)
    config = transformers.ViTConfig(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn,
                                    num_hidden_layers=layers, image_size=size, patch_size=16, num_labels=1000)
    dims = (f"ViTForImageClassification h{hidden}/{heads}h/ffn{ffn}, patch 16, {layers} of 12 layers; "
            f"{batch}x3x{size}x{size}")

    def make(g: torch.Generator) -> Inputs:
        return (torch.randn(batch, 3, size, size, generator=g),)
    return Spec(dims, transformers.ViTForImageClassification(config), make, _logits)


def whisper(quick: bool) -> Spec:
    import transformers

    d_model, heads, ffn, layers, frames = (64, 4, 256, 2, 100) if quick else (512, 8, 2048, 4, 3000)
    config = transformers.WhisperConfig(d_model=d_model, encoder_attention_heads=heads, encoder_ffn_dim=ffn,
                                        encoder_layers=layers, decoder_attention_heads=heads, decoder_ffn_dim=ffn,
                                        decoder_layers=1, num_mel_bins=80, max_source_positions=frames // 2)
    dims = (f"WhisperModel.get_encoder() d{d_model}/{heads}h/ffn{ffn}, {layers} of 6 layers; mel 1x80x{frames}"
            + ("" if quick else " (30 s)"))

    def make(g: torch.Generator) -> Inputs:
        return (torch.randn(1, 80, frames, generator=g),)
    return Spec(dims, transformers.WhisperModel(config).get_encoder(), make, _hidden)


def llama(quick: bool) -> Spec:
    """Prefill as ``generate`` runs it: the KV cache is built and only the last position's logits are computed."""
    import transformers

    hidden, ffn, heads, kv, layers, vocab, length = ((64, 256, 4, 2, 2, 1000, 32) if quick
                                                     else (2048, 8192, 32, 8, 4, 32000, 512))
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                                      num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
                                      max_position_embeddings=max(2048, length))
    model = transformers.LlamaForCausalLM(config)
    # by position: fxquant.quantize takes positional example inputs (and calibration tuples feed them alike)
    keep = list(inspect.signature(model.forward).parameters).index("logits_to_keep")
    dims = (f"LlamaForCausalLM h{hidden}/ffn{ffn}/{heads}q{kv}kv, vocab {vocab}, {layers} of 16 layers; "
            f"prefill 1x{length}, KV cache, last logits")

    def make(g: torch.Generator) -> Inputs:
        ids = torch.randint(0, vocab, (1, length), generator=g)
        return (ids, *[None] * (keep - 1), 1)
    return Spec(dims, model, make, _logits)


SPECS: dict[str, Callable[[bool], Spec]] = {"bert": bert, "vit": vit, "whisper": whisper, "llama": llama}


def build_case(name: str, *, quick: bool, calib_batches: int) -> HfCase:
    """The row ``name`` with seeded random weights, seed-0 timed inputs and seeds 1..n for calibration."""
    torch.manual_seed(0)
    spec = SPECS[name](quick)
    calibration = tuple(spec.make_inputs(torch.Generator().manual_seed(s)) for s in range(1, calib_batches + 1))
    return HfCase(name, spec.dims, spec.model.eval(), spec.make_inputs(torch.Generator().manual_seed(0)),
                  calibration, spec.output)

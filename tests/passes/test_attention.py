"""``fuse_attention``: hand-written attention becomes one ``F.scaled_dot_product_attention`` call at prepare, with
the float function unchanged (within float rounding), and only where nothing else reads the scores or weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant.calibration import observers_of
from fxquant.models import create_model, example_inputs
from fxquant.qparams import sqnr_db


class _Attention(nn.Module):
    """One attention head group, written in one of several common ways (``style``)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.softmax, self.dropout = nn.Softmax(dim=-1), nn.Dropout(0.1)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (layer(x).unflatten(-1, (4, 8)).transpose(1, 2) for layer in (self.q, self.k, self.v))
        if self.style == "div_mask_module":  # HF BERT's eager attention: / sqrt(d), + mask, nn.Softmax, dropout
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8) + mask
            context = torch.matmul(self.dropout(self.softmax(scores)), v)
        elif self.style == "permute_mask_first":
            scores = mask + torch.matmul(q, k.permute(0, 1, 3, 2)) * 0.3
            context = torch.matmul(F.softmax(scores, dim=-1), v)
        elif self.style == "unscaled_method":
            context = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        elif self.style == "weights_returned":  # the probabilities are read twice: not rewritten
            probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            return self.out((probs @ v).transpose(1, 2).flatten(-2)) + probs.mean()
        elif self.style == "softmax_over_queries":  # not attention over keys: not rewritten
            context = torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v
        else:  # "bool_mask": a 0/1 boolean mask added to the scores means something else to SDPA
            context = torch.softmax(q @ k.transpose(-2, -1) + (mask > 0), dim=-1) @ v
        return self.out(context.transpose(1, 2).flatten(-2))


def _sdpa_calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 6, 32, generator=gen), torch.randn(2, 1, 1, 6, generator=gen)


@pytest.mark.parametrize(("style", "rewritten"), [
    ("div_mask_module", True), ("permute_mask_first", True), ("unscaled_method", True),
    ("weights_returned", False), ("softmax_over_queries", False), ("bool_mask", False),
])
def test_attention_patterns_become_sdpa_with_the_same_float_function(style: str, rewritten: bool) -> None:
    torch.manual_seed(0)
    model = _Attention(style).eval()
    prepared = fxquant.prepare(model, _inputs(0))
    assert _sdpa_calls(prepared) == int(rewritten)
    softmaxes = [n for n in prepared.graph.nodes if "softmax" in str(n.target).lower()]
    assert bool(softmaxes) is not rewritten
    for observer in observers_of(prepared).values():
        observer.enabled = False
    x, mask = _inputs(1)
    with torch.no_grad():
        assert torch.allclose(prepared(x, mask), model(x, mask), rtol=1e-5, atol=1e-5)


def test_bert_style_encoder_runs_fused_attention_and_keeps_its_int8_accuracy() -> None:
    """Every layer of the zoo's encoder: SDPA in the prepared and converted graphs, INT8 SQNR as before (>= 40 dB on
    the backends whose Linears read by float code return float)."""
    model = create_model("bert_style", layers=2)
    prepared = fxquant.prepare(model, example_inputs("bert_style", 2, seed=1), fxquant.QuantConfig(backend="onednn"))
    assert _sdpa_calls(prepared) == 2
    fxquant.calibrate(prepared, [example_inputs("bert_style", 2, seed=s) for s in range(2, 6)], progress=False)
    qmodel = fxquant.convert(prepared)
    assert _sdpa_calls(qmodel) == 2
    x = example_inputs("bert_style", 2, seed=9)
    with torch.inference_mode():
        assert sqnr_db(model(*x), qmodel(*x)) >= 40.0

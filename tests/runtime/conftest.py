"""Fixtures the runtime tests share."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.models import create_model, example_inputs


@pytest.fixture(scope="module")
def prepared_bert_style() -> torch.fx.GraphModule:
    """The zoo's BERT-style encoder prepared and calibrated at batch 2: each converted model's 4 SDPA nodes and 9
    add + LayerNorm pairs are what the runtime's float loops take."""
    model = create_model("bert_style")
    prepared = fxquant.prepare(model, example_inputs("bert_style", 2))
    fxquant.calibrate(prepared, [example_inputs("bert_style", 2, seed=s) for s in range(1, 5)], progress=False)
    return prepared

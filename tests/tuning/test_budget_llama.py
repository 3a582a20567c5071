"""The budget search on a tiny Llama (transformers): a dynamic base with weight-only fallback, by kind of layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from budget_testing import synthetic_loss
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.nn.schemes import SchemeLinear
from fxquant.state import graph_of, quant_state
from fxquant.tuning.budget import FALLBACK_KEY, quantize_within_budget
from fxquant.tuning.candidates import layer_kind
from fxquant.tuning.sensitivity import int8_layers, layer_sqnr

transformers = pytest.importorskip("transformers")
DOWN = "model.layers.*.mlp.down_proj"


def _llama() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval(), [torch.randint(3, 64, (2, 12)) for _ in range(4)]


def _linears(model: nn.Module) -> dict[str, str]:
    """Module path -> class of every Linear, float or INT8 (bare, or inside the island convert may leave)."""
    return {path: type(module).__name__ for path, module in model.named_modules()
            if isinstance(module, (nn.Linear, SchemeLinear))}


def test_isolated_sqnr_ranks_every_dynamic_and_weight_only_layer() -> None:
    """Scheme layers, bare where convert unwrapped their islands, are measured like static ones."""
    model, data = _llama()
    prepared = fxquant.prepare(model, (data[0],), QuantConfig(smoothquant_alpha=0.4))
    fxquant.calibrate(prepared, data, progress=False)
    mixed = graph_of(fxquant.convert(prepared, schemes={"*down_proj": "weight_only", "*": "dynamic"}))
    layers = int8_layers(prepared, mixed)
    assert len(layers) == 15 and {layer.scheme for layer in layers.values()} == {"dynamic", "weight_only"}
    sqnr = layer_sqnr(prepared, mixed, data[:2])
    assert set(sqnr) == set(layers) and all(20 < db < 80 for db in sqnr.values()), sqnr


def test_dynamic_base_with_weight_only_fallback_by_kind_round_trips(tmp_path: Path) -> None:
    model, data = _llama()
    costs = {path: 0.1 for path in _linears(model) if path.endswith("down_proj")}  # only down_proj's error counts
    qmodel = quantize_within_budget(model, (data[0],), data, QuantConfig(smoothquant_alpha=0.4),
                                    eval_fn=synthetic_loss(costs, when="DynamicInt8Linear"), higher_is_better=False,
                                    max_relative_drop=5.0, fallback="weight_only", schemes={"*": "dynamic"},
                                    granularity="kind", max_trials=8, progress=False)
    result = graph_of(qmodel).meta[FALLBACK_KEY]
    assert all(layer_kind(kind) == kind for kind in result.sensitivity), result.sensitivity
    assert result.met_budget and result.fallback_layers == (DOWN,), result.to_markdown()
    assert result.conversion().schemes == {DOWN: "weight_only", "*": "dynamic"}
    assert quant_state(qmodel).schemes == result.conversion().schemes
    kinds = _linears(qmodel)
    expected = {path: "WeightOnlyInt8Linear" if path.endswith("down_proj") else "DynamicInt8Linear" for path in kinds}
    assert len(kinds) == 15 and kinds == expected, kinds
    fxquant.save(qmodel, tmp_path / "llama")
    loaded = fxquant.load(tmp_path / "llama", model)
    assert _linears(loaded) == kinds
    assert torch.equal(loaded(data[0]).logits, qmodel(data[0]).logits)

"""A Hugging Face BertModel (random weights from a small BertConfig, no download): every Linear runs INT8.

torch.fx cannot trace BertModel (its forward rewrites kwargs, iterates proxies, unpacks shapes): partial tracing
keeps those forwards as written and quantizes every Linear below them, LayerNorm/GELU/softmax staying float.
"""

from __future__ import annotations

import pytest
import torch

import fxquant

transformers = pytest.importorskip("transformers", reason="the optional 'transformers' extra is not installed")


def test_every_linear_of_a_bert_model_is_int8_and_embeddings_stay_close() -> None:
    config = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    batches = [{"input_ids": torch.randint(0, 500, (4, 24)), "attention_mask": torch.ones(4, 24, dtype=torch.long)}
               for _ in range(4)]
    example = (batches[0]["input_ids"], batches[0]["attention_mask"])
    prepared = fxquant.prepare(model, example)
    fxquant.calibrate(prepared, batches, progress=False)
    qmodel = fxquant.convert(prepared)
    report = fxquant.coverage(qmodel)
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {r.path for r in report.layers if r.quantized} == linears, str(report)
    assert any("forward of the model itself" in b for b in report.graph_breaks)
    fresh = torch.randint(0, 500, (4, 24))
    mask = torch.ones(4, 24, dtype=torch.long)
    with torch.inference_mode():
        reference = model(fresh, mask).last_hidden_state
        actual = qmodel(fresh, mask).last_hidden_state
    cosine = torch.nn.functional.cosine_similarity(reference.flatten(1), actual.flatten(1)).mean().item()
    assert cosine >= 0.99, f"mean cosine similarity {cosine:.4f}"


def _converted(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.fx.GraphModule:
    prepared = fxquant.prepare(model, (batches[0]["input_ids"], batches[0]["attention_mask"]))
    fxquant.calibrate(prepared, batches, progress=False)
    return fxquant.convert(prepared)


def test_islands_reading_one_value_share_its_quantize_and_outputs_do_not_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """query/key/value read one ``hidden_states``: one quantize, not three. (The output block's residual add
    runs float, so only the intermediate block quantizes the attention output.) The shared int8 tensor is the one
    each would have made, so the output is bit-identical to converting without sharing."""
    import fxquant.passes.islands

    config = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertModel(config).eval()
    batches = [{"input_ids": torch.randint(0, 300, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
               for _ in range(3)]
    shared = _converted(model, batches)
    with monkeypatch.context() as patch:
        patch.setattr(fxquant.passes.islands, "_share_input_quantizes", lambda gm: None)
        separate = _converted(model, batches)
    before, after = fxquant.coverage(separate), fxquant.coverage(shared)
    layers = config.num_hidden_layers
    assert after.quantize_nodes == before.quantize_nodes - 2 * layers, (str(before), str(after))
    assert after.dequantize_nodes == before.dequantize_nodes
    fresh, mask = torch.randint(0, 300, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    with torch.inference_mode():
        assert torch.equal(shared(fresh, mask).last_hidden_state, separate(fresh, mask).last_hidden_state)
    with torch.no_grad():  # tensors with version counters take the same path
        assert torch.equal(shared(fresh, mask).last_hidden_state, separate(fresh, mask).last_hidden_state)

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

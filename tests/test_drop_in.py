"""Drop-in models: where the root's forward does not trace, ``convert`` returns the user's own module (its class,
attributes, methods and outputs) with INT8 layers inside, and every fxquant function accepts it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fxquant
from fxquant.nn.quantized import _QuantizedWeighted
from fxquant.state import graph_of, quant_state


class Tagger(nn.Module):
    """A root torch.fx cannot trace (a data-dependent early return), with a method and an attribute of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.labels = ("a", "b", "c")
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        if bool((ids == 0).all()):
            return {"logits": torch.zeros(*ids.shape, 3)}
        return {"logits": self.head(self.body(x)), "hidden": x}

    def tag(self, ids: torch.Tensor) -> list[str]:
        return [self.labels[i] for i in self.forward(ids)["logits"].argmax(-1).flatten().tolist()]


def _quantized() -> tuple[Tagger, nn.Module]:
    torch.manual_seed(0)
    model = Tagger().eval()
    data = [torch.randint(1, 50, (4, 8)) for _ in range(4)]
    return model, fxquant.quantize(model, (data[0],), data, fxquant.QuantConfig(backend="reference"), progress=False)


def test_the_result_is_the_users_class_with_int8_layers() -> None:
    model, qmodel = _quantized()
    assert type(qmodel) is Tagger and qmodel.labels == model.labels
    assert any(isinstance(m, _QuantizedWeighted) for m in qmodel.modules())
    ids = torch.randint(1, 50, (2, 8))
    out = qmodel(ids)
    assert set(out) == {"logits", "hidden"} and torch.equal(out["hidden"], model(ids)["hidden"])
    assert len(qmodel.tag(ids)) == 16  # the user's own method, running INT8 layers


def test_state_dict_keys_of_float_parts_are_unchanged() -> None:
    model, qmodel = _quantized()
    keys = set(qmodel.state_dict())
    assert "embed.weight" in keys and torch.equal(qmodel.state_dict()["embed.weight"], model.embed.weight)
    assert not any(key.startswith("_fxquant") or key.startswith("model.") for key in keys)


def test_every_fxquant_function_accepts_it(tmp_path: Path) -> None:
    model, qmodel = _quantized()
    assert quant_state(qmodel).stage == "converted" and graph_of(qmodel) is not qmodel
    assert fxquant.coverage(qmodel).quantized_fraction == 1.0
    assert "call_module" in fxquant.format_graph(qmodel)
    path = fxquant.save(qmodel, tmp_path / "tagger")
    loaded = fxquant.load(path, model)
    ids = torch.randint(1, 50, (2, 8))
    assert type(loaded) is Tagger
    assert torch.equal(loaded(ids)["logits"], qmodel(ids)["logits"])


def test_a_root_that_traces_stays_a_graph_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(4, 8)
    qmodel = fxquant.quantize(model, (x,), [x], fxquant.QuantConfig(backend="reference"), progress=False)
    assert isinstance(qmodel, torch.fx.GraphModule) and graph_of(qmodel) is qmodel


def test_a_hugging_face_decoder_keeps_generate_and_its_config() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    data = [torch.randint(3, 64, (2, 12)) for _ in range(4)]
    qmodel = fxquant.quantize(model, (data[0],), data, progress=False)
    assert isinstance(qmodel, transformers.LlamaForCausalLM) and qmodel.config is not None
    assert qmodel.config.to_dict() == model.config.to_dict()
    out = qmodel(data[0])
    assert type(out) is type(model(data[0])) and out.logits.shape == (2, 12, 64)
    prompt = torch.randint(3, 64, (1, 5))
    generated = qmodel.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape[1] == 11 and torch.equal(generated[:, :5], prompt)
    assert fxquant.coverage(qmodel).int8_mac_fraction == 1.0

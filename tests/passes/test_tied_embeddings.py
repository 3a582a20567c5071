"""A tied input embedding reads its INT8 head's rows after convert (``fxquant.passes.tied_embeddings``): no float
copy of a quantized weight stays, the vectors are the head's dequantized rows, and it stays float wherever the head
does not compute with the embedding's matrix or the user keeps it float."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import fxquant
from fxquant.nn.quantized import QuantizedLinear
from fxquant.nn.tied_embedding import TiedInt8Embedding
from fxquant.passes import smoothquant_alphas
from fxquant.passes.tied_embeddings import head_column_scales, tied_heads

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN = 96, 64


def _llama(tied: bool = True) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def _data(count: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (2, 12), generator=g) for _ in range(count)]


def _convert(model: nn.Module, config: fxquant.QuantConfig | None = None, **options: object) -> nn.Module:
    data = _data()
    prepared = fxquant.prepare(model, (data[0],), config)
    fxquant.calibrate(prepared, data, progress=False)
    return fxquant.convert(prepared, **options)  # type: ignore[arg-type]


def _reference_rows(head: nn.Module) -> torch.Tensor:
    """The head's float weight from its int8 weight and scales, computed here (not by the layer's own helpers)."""
    int8 = head.int8_weight().float()
    scale = head.weight_scale.view(int8.shape[0], -1, 1)
    weight = (int8.view(int8.shape[0], scale.shape[1], -1) * scale).view_as(int8)
    return weight if head.input_scale is None else weight * head.input_scale


@pytest.mark.parametrize("scheme", ["dynamic_group", "dynamic", "weight_only"])
def test_the_embedding_reads_the_heads_int8_rows(scheme: str) -> None:
    model = _llama()
    float_weight = model.model.embed_tokens.weight.detach().clone()
    qmodel = _convert(model, fxquant.QuantConfig(scheme=scheme))
    embedding = qmodel.model.embed_tokens
    assert isinstance(embedding, TiedInt8Embedding) and embedding.head is qmodel.lm_head
    ids = torch.tensor([[0, 5, VOCAB - 1, 31], [32, 33, 63, 64]])
    reference = _reference_rows(qmodel.lm_head)
    assert torch.equal(embedding(ids), reference[ids])
    assert torch.equal(embedding.weight, reference)
    # the vectors are the float ones within half an int8 step of their row (or group)
    scale = qmodel.lm_head.weight_scale.view(VOCAB, -1)  # one per row, or per group of inputs of each row
    step = scale.repeat_interleave(HIDDEN // scale.shape[1], dim=1)
    assert ((reference - float_weight).abs() <= step / 2 + 1e-7).all()


def test_no_float_copy_of_the_matrix_stays() -> None:
    model = _llama()
    qmodel = _convert(model)
    tensors = [*qmodel.parameters(), *qmodel.buffers()]
    assert not any(t.dtype == torch.float32 and t.shape == (VOCAB, HIDDEN) for t in tensors)
    assert "model.embed_tokens.weight" not in qmodel.state_dict()
    assert sum(m is qmodel.lm_head for m in qmodel.modules()) == 1  # not a second submodule
    row = next(r for r in fxquant.coverage(qmodel).layers if r.path == "model.embed_tokens")
    assert row.quantized and row.scheme == "dynamic_group" and "lm_head" in row.reason


def test_generate_save_load_and_deepcopy_keep_the_tie(tmp_path: Path) -> None:
    model = _llama()
    qmodel = _convert(model)
    prompt = torch.randint(3, VOCAB, (1, 5))
    generated = qmodel.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 11) and torch.equal(generated[:, :5], prompt)
    ids = _data(1)[0]
    loaded = fxquant.load(fxquant.save(qmodel, tmp_path / "tied"), model)
    assert isinstance(loaded.model.embed_tokens, TiedInt8Embedding) and loaded.model.embed_tokens.head is loaded.lm_head
    assert torch.equal(loaded(ids).logits, qmodel(ids).logits)
    copied = copy.deepcopy(qmodel)
    assert copied.model.embed_tokens.head is copied.lm_head and copied.lm_head is not qmodel.lm_head
    assert torch.equal(copied(ids).logits, qmodel(ids).logits)


def test_out_of_range_ids_raise_like_nn_embedding() -> None:
    embedding = _convert(_llama()).model.embed_tokens
    for ids in (torch.tensor([VOCAB]), torch.tensor([-1])):
        with pytest.raises(IndexError, match="index out of range"):
            embedding(ids)
    assert embedding(torch.zeros(0, dtype=torch.long)).shape == (0, HIDDEN)


def test_kept_float_where_asked_or_where_the_head_is_float() -> None:
    model = _llama()
    float_weight = model.model.embed_tokens.weight.detach().clone()
    kept = _convert(model, keep_float=["*embed_tokens"])
    assert type(kept.model.embed_tokens) is nn.Embedding
    assert torch.equal(kept.model.embed_tokens.weight, float_weight)
    head_float = _convert(model, keep_float=["lm_head"])
    assert type(head_float.model.embed_tokens) is nn.Embedding
    assert head_float.lm_head.weight is head_float.model.embed_tokens.weight  # still tied, both float
    untied = _convert(_llama(tied=False))
    assert type(untied.model.embed_tokens) is nn.Embedding


def test_a_smoothed_head_with_its_scale_inside_still_gives_the_float_vectors() -> None:
    model = _llama()
    float_weight = model.model.embed_tokens.weight.detach().clone()
    qmodel = _convert(model, fxquant.QuantConfig(scheme="static", smoothquant_alpha=0.5),
                      schemes={"*": "dynamic_group"})
    head = qmodel.lm_head
    assert head.input_scale is not None  # the recipe smoothed the head: its int8 weight is W * s
    embedding = qmodel.model.embed_tokens
    assert isinstance(embedding, TiedInt8Embedding)
    reference = _reference_rows(head)
    assert torch.equal(embedding.weight, reference)
    step = head.weight_scale.view(VOCAB, 1) * head.input_scale.view(1, HIDDEN)  # a step of W * s, divided by s
    assert ((reference - float_weight).abs() <= step / 2 + 1e-7).all()


class TiedTagger(nn.Module):
    """A traceable tied model whose head reads a LayerNorm only it reads: SmoothQuant folds 1/s into the norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(ids))))


def test_a_head_smoothed_through_its_producer_scales_the_rows_back() -> None:
    torch.manual_seed(0)
    model = TiedTagger().eval()
    float_weight = model.embed.weight.detach().clone()
    qmodel = _convert(model, fxquant.QuantConfig(scheme="static", smoothquant_alpha=0.5),
                      schemes={"*": "dynamic_group"})
    head = qmodel.get_submodule("head")
    assert head.input_scale is None and smoothquant_alphas(qmodel)["head"] == 0.5  # 1/s went into the norm
    embedding = qmodel.get_submodule("embed")
    assert isinstance(embedding, TiedInt8Embedding) and embedding.column_scale is not None
    smoothed = _reference_rows(head)  # Q(W * s)
    ids = _data(1)[0]
    assert torch.equal(embedding(ids), smoothed[ids] * embedding.column_scale)
    # 1/s is SmoothQuant's: the float head it lowered holds W * s, and W * s * (1/s) is the float matrix again
    step = head.weight_scale.view(VOCAB, 1) * embedding.column_scale.view(1, HIDDEN)
    assert ((embedding.weight - float_weight).abs() <= step / 2 + 1e-6).all()
    assert not torch.allclose(embedding.column_scale, torch.ones(HIDDEN))


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_a_static_head_shares_its_rows(alpha: float | None) -> None:
    model = _llama()
    float_weight = model.model.embed_tokens.weight.detach().clone()
    qmodel = _convert(model, fxquant.QuantConfig(scheme="static", backend="reference", smoothquant_alpha=alpha))
    embedding = qmodel.model.embed_tokens
    assert isinstance(embedding, TiedInt8Embedding) and isinstance(embedding.head, QuantizedLinear)
    head = embedding.head
    int8 = head.weight.float() - head.weight_zero_point.float().view(-1, 1)
    reference = int8 * head.weight_scale.view(-1, 1)
    if alpha is None:
        assert embedding.column_scale is None
    else:
        assert embedding.column_scale is not None
        reference = reference * embedding.column_scale
    ids = _data(1)[0]
    assert torch.equal(embedding(ids), reference[ids])
    step = head.weight_scale.view(VOCAB, 1) * (1 if embedding.column_scale is None else embedding.column_scale)
    assert ((reference - float_weight).abs() <= step / 2 + 1e-6).all()
    row = next(r for r in fxquant.coverage(qmodel).layers if r.path == "model.embed_tokens")
    assert row.scheme == "static" and row.reason == "lookup in lm_head's int8 weight (tied)"


def test_column_scales_are_read_only_off_a_column_scaled_head() -> None:
    torch.manual_seed(0)
    model = TiedTagger()
    assert head_column_scales(model, tied_heads(model)) == {"embed": None}
    s = torch.rand(HIDDEN) + 0.5
    model.head.weight = nn.Parameter(model.embed.weight.detach() * s)
    found = head_column_scales(model, {"embed": "head"})["embed"]
    assert found is not None and torch.allclose(found, s, rtol=1e-6)
    model.head.weight = nn.Parameter(model.embed.weight.detach() * s + 1e-3 * torch.randn(VOCAB, HIDDEN))
    assert head_column_scales(model, {"embed": "head"}) == {}


def test_a_traced_model_shares_too() -> None:
    torch.manual_seed(0)
    model = TiedTagger().eval()
    qmodel = _convert(model, fxquant.QuantConfig(scheme="dynamic_group"))
    embedding = qmodel.get_submodule("embed")
    assert isinstance(embedding, TiedInt8Embedding) and embedding.head is qmodel.get_submodule("head")
    ids = _data(1)[0]
    rows = _reference_rows(qmodel.get_submodule("head"))[ids]  # the graph looks its input up in the head's rows
    expected = qmodel.get_submodule("head")(qmodel.get_submodule("norm")(qmodel.get_submodule("body")(rows)))
    assert torch.equal(qmodel(ids), expected)


class SharedEmbeddings(nn.Module):
    """One embedding module at two paths (as T5's ``shared`` and ``encoder.embed_tokens``), tied to the head; its
    forward does not trace (a data-dependent branch), so the converted model is this class with both paths."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(VOCAB, HIDDEN)
        self.encoder = nn.Module()
        self.encoder.embed_tokens = self.shared
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if bool((ids == 0).all()):
            return torch.zeros(*ids.shape, VOCAB)
        return self.head(self.body(self.encoder.embed_tokens(ids) + self.shared(ids.flip(-1))))


def test_an_embedding_at_two_paths_is_replaced_at_both() -> None:
    torch.manual_seed(0)
    model = SharedEmbeddings().eval()
    qmodel = _convert(model, fxquant.QuantConfig(scheme="dynamic_group"))
    shared, inner = qmodel.get_submodule("shared"), qmodel.get_submodule("encoder.embed_tokens")
    assert isinstance(shared, TiedInt8Embedding) and inner is shared  # no path keeps the float matrix alive
    kept = _convert(model, fxquant.QuantConfig(scheme="dynamic_group"), keep_float=["encoder.*"])
    assert type(kept.get_submodule("shared")) is nn.Embedding  # kept float at one path: float at both

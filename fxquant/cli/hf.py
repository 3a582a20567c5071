"""``--model transformers:FOLDER`` (or a path to a folder with ``config.json``): a Hugging Face model as users have it.

The folder is what ``save_pretrained`` writes (``config.json`` plus ``model.safetensors`` or sharded weights, and
the tokenizer's files); a hub model id (``transformers:HuggingFaceTB/SmolLM2-135M``) loads from the local Hugging
Face cache or, where the network allows, the hub. The model class is the one ``config.json`` names
(``architectures[0]``, e.g. ``LlamaForCausalLM``), so the quantized model is the user's class with ``generate()``;
weights load as float32. Nothing from the folder is executed: ``trust_remote_code`` stays off (a model whose class
lives in the folder's own Python files is refused with that reason), and a run directory that names a folder is
authorized like one that names a factory (:mod:`fxquant.cli.source`) and checked against the recorded state-dict
hash at every stage.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from fxquant.errors import InputError

PREFIX = "transformers:"


def is_hf_spec(spec: str) -> bool:
    """A model spec naming a Hugging Face model rather than a ``PKG.MODULE:FACTORY``."""
    return spec.startswith(PREFIX)


def normalize_model_spec(spec: str) -> str:
    """``prepare --model``: a path to a folder holding ``config.json`` becomes ``transformers:<absolute folder>``
    (later stages find it wherever they run from); every other spec is returned as given."""
    if is_hf_spec(spec):
        name = spec[len(PREFIX):]
        folder = Path(name).expanduser()
        return PREFIX + str(folder.resolve()) if folder.is_dir() else spec
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise InputError(f"--model {spec!r} is a folder without config.json: not a Hugging Face model folder "
                             "(save one with model.save_pretrained(FOLDER)); or pass PKG.MODULE:FACTORY")
        return PREFIX + str(folder.resolve())
    return spec


def hub_unresolved() -> str | None:
    """Why the Hugging Face hub's host cannot be resolved (no network), found at once; None when it can. The
    libraries themselves retry for half a minute first."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return f"no network: cannot resolve {host} ({exc.strerror or exc})"
    return None


def _cache_only(name: str) -> bool:
    """Load ``name`` without asking the hub: it is a local folder, or the hub cannot be reached (the cache decides,
    at once)."""
    return Path(name).expanduser().is_dir() or hub_unresolved() is not None


def _where(spec: str) -> str:
    name = spec[len(PREFIX):]
    if not name:
        raise InputError(f"--model {spec!r} names no model: give transformers:FOLDER or transformers:HUB_ID")
    return name


def _architecture(name: str) -> str | None:
    """The class ``config.json`` names: read from the folder, or from the hub id's config (cache or network)."""
    config = Path(name).expanduser() / "config.json"
    if config.is_file():
        try:
            architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"--model {PREFIX}{name}: config.json is not valid JSON ({exc})") from None
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(name, trust_remote_code=False, local_files_only=_cache_only(name))
            architectures = config.architectures or []
        except (OSError, ValueError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InputError(f"--model {PREFIX}{name}: no such folder, and no Hugging Face model of that id in the "
                             f"local cache or on the hub ({reason[:200]}); give a folder written by "
                             "save_pretrained") from None
    return architectures[0] if architectures and isinstance(architectures[0], str) else None


def _model_class(name: str) -> Any:
    import transformers

    architecture = _architecture(name)
    if architecture is None:
        return transformers.AutoModel
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise InputError(f"--model {PREFIX}{name}: config.json names the class {architecture!r}, which transformers "
                         f"{transformers.__version__} does not define (custom code in the folder is never run: "
                         "trust_remote_code stays off); upgrade transformers or pass PKG.MODULE:FACTORY")
    return cls


def load_hf_model(spec: str) -> nn.Module:
    """The float32 model ``spec`` names, of the class its ``config.json`` names, in eval mode."""
    name = _where(spec)
    cls = _model_class(name)
    try:
        model = cls.from_pretrained(name, dtype=torch.float32, trust_remote_code=False,
                                    local_files_only=_cache_only(name))
    except (OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"--model {spec!r}: cannot load a Hugging Face model from it ({reason}); give a folder "
                         "written by save_pretrained, or a hub id in the local cache") from None
    return model.eval()


def load_tokenizer(spec: str) -> Any:
    """The tokenizer saved beside the model ``spec`` names (``AutoTokenizer``; no code from the folder runs)."""
    from transformers import AutoTokenizer

    name = _where(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False, local_files_only=_cache_only(name))
    except (OSError, ValueError, TypeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"--model {spec!r} has no tokenizer fxquant can load ({reason[:200]}); save one beside "
                         "the model with tokenizer.save_pretrained(FOLDER), or pass --tokenizer FOLDER") from None
    if isinstance(tokenizer, bool) or not hasattr(tokenizer, "encode"):
        raise InputError(f"--model {spec!r}: its folder holds no tokenizer; save one with "
                         "tokenizer.save_pretrained(FOLDER), or pass --tokenizer FOLDER")
    return tokenizer


def context_length(model: nn.Module) -> int | None:
    """The longest sequence ``model`` takes (``config.max_position_embeddings`` or the like), None when unknown."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocabulary_size(model: nn.Module) -> int:
    """How many token ids ``model`` embeds: its config's ``vocab_size``, else its input embedding's rows."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(embeddings, nn.Embedding):
        return embeddings.num_embeddings
    raise InputError("--example-inputs tokens:BxT needs a model with a vocabulary (config.vocab_size or an input "
                     "embedding); give shapes or PKG.MODULE:FUNCTION instead")

"""Tiny models for tests/models/test_hf_zoo.py: Hugging Face architectures built from small configs with random
weights (no download), and CNNs written the way timm and efficientnet_pytorch write them.

Each :class:`Arch` builds its model and makes a batch of keyword inputs for a seed; ``main`` names the output that
the tests compare (``logits``, ``last_hidden_state``, or an index into a tuple).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from fxquant.models._blocks import Conv2dStaticSamePadding

VOCAB, SEQ, BATCH = 512, 16, 2
Inputs = dict[str, Any]


@dataclass(frozen=True)
class Arch:
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Inputs]
    main: str | int = "logits"


def _ids(g: torch.Generator, mask: bool = True, vocab: int = VOCAB) -> Inputs:
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if mask else {"input_ids": ids}


def _tokens(g: torch.Generator) -> Inputs:
    return _ids(g, mask=False)


def _pixels(g: torch.Generator, size: int = 32) -> Inputs:
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=g)}


def _image(g: torch.Generator) -> Inputs:
    return {"x": _pixels(g)["pixel_values"]}


def _audio(g: torch.Generator) -> Inputs:
    return {"input_values": torch.randn(BATCH, 1600, generator=g)}


TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64)
DECODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=64)
VIT = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           intermediate_size=128, num_labels=10)
SPEECH = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
              conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
WHISPER = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
               max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1)


def _hf(model_class: type, config_class: type, **options: Any) -> Callable[[], nn.Module]:
    return lambda: _trained_batchnorm(model_class(config_class(**options))).eval()


def _trained_batchnorm(model: nn.Module) -> nn.Module:
    """BatchNorm statistics and affine parameters that are not the identity (as after training), so folding them is
    exercised; transformers' random init also draws BatchNorm weights of ~0.02, which makes MobileViT output 0."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    return model


def _whisper_encoder() -> nn.Module:
    return tf.WhisperModel(tf.WhisperConfig(**WHISPER)).get_encoder().eval()


def _mel(g: torch.Generator) -> Inputs:
    return {"input_features": torch.randn(BATCH, 16, 64, generator=g)}


def _mel_and_tokens(g: torch.Generator) -> Inputs:
    return {**_mel(g), "decoder_input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}


def _decoder(model: type, config: type, **options: Any) -> Arch:
    return Arch(_hf(model, config, **{**DECODER, **options}), _tokens)


# --- CNNs written as efficientnet_pytorch and timm write them ----------------------------------------------------
class MemoryEfficientSwish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: identity in eval."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class DropPath(nn.Module):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)


class MBConvBlock(nn.Module):
    """efficientnet_pytorch's MBConv: expand, depthwise (same padding), squeeze-excitation, project, drop-connect."""

    def __init__(self, cin: int, cout: int, stride: int, size: int, expand: int = 4) -> None:
        super().__init__()
        mid, squeezed = cin * expand, max(1, cin // 4)
        self._expand_conv = Conv2dStaticSamePadding(cin, mid, 1, image_size=size)
        self._bn0 = nn.BatchNorm2d(mid)
        self._depthwise_conv = Conv2dStaticSamePadding(mid, mid, 3, stride, groups=mid, image_size=size)
        self._bn1 = nn.BatchNorm2d(mid)
        self._se_reduce = Conv2dStaticSamePadding(mid, squeezed, 1, image_size=1, bias=True)
        self._se_expand = Conv2dStaticSamePadding(squeezed, mid, 1, image_size=1, bias=True)
        self._project_conv = Conv2dStaticSamePadding(mid, cout, 1, image_size=math.ceil(size / stride))
        self._bn2 = nn.BatchNorm2d(cout)
        self._swish = MemoryEfficientSwish()
        self.id_skip = stride == 1 and cin == cout

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self._swish(self._bn0(self._expand_conv(inputs)))
        x = self._swish(self._bn1(self._depthwise_conv(x)))
        squeezed = self._se_expand(self._swish(self._se_reduce(F.adaptive_avg_pool2d(x, 1))))
        x = torch.sigmoid(squeezed) * x
        x = self._bn2(self._project_conv(x))
        if self.id_skip:
            x = drop_path(x, 0.2, self.training) + inputs
        return x


class EfficientNetStyle(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self._conv_stem = Conv2dStaticSamePadding(3, 16, 3, 2, image_size=32)
        self._bn0 = nn.BatchNorm2d(16)
        self._blocks = nn.ModuleList([MBConvBlock(16, 16, 1, 16), MBConvBlock(16, 24, 2, 16),
                                      MBConvBlock(24, 24, 1, 8)])
        self._conv_head = Conv2dStaticSamePadding(24, 64, 1, image_size=8)
        self._bn1 = nn.BatchNorm2d(64)
        self._fc = nn.Linear(64, num_classes)
        self._swish = MemoryEfficientSwish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._swish(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = self._swish(self._bn1(self._conv_head(x)))
        return self._fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LayerNorm2d(nn.LayerNorm):
    """timm's channels-first LayerNorm: permute, layer_norm, permute back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class SqueezeExcite(nn.Module):
    """timm's SE with a hard-sigmoid gate (MobileNetV3)."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.conv_reduce = nn.Conv2d(channels, reduced, 1)
        self.act1 = nn.ReLU(inplace=True)
        self.conv_expand = nn.Conv2d(reduced, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        se = self.conv_expand(self.act1(self.conv_reduce(x.mean((2, 3), keepdim=True))))
        return x * self.gate(se)


class ConvNeXtBlock(nn.Module):
    """timm's ConvNeXt block: depthwise 7x7, LayerNorm, MLP with hard-swish here, layer scale, drop path."""

    def __init__(self, dim: int, se: bool = False) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = LayerNorm2d(dim, eps=1e-6)
        self.se = SqueezeExcite(dim, dim // 4) if se else nn.Identity()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.Hardswish(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))
        self.drop_path = DropPath(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.se(self.norm(self.conv_dw(x)))
        x = self.fc2(self.act(self.fc1(x.permute(0, 2, 3, 1))))
        x = (x * self.gamma).permute(0, 3, 1, 2)
        return self.drop_path(x) + shortcut


class ConvNeXtTimmStyle(nn.Module):
    def __init__(self, num_classes: int = 10, dims: tuple[int, int] = (32, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        self.stages = nn.Sequential(
            ConvNeXtBlock(dims[0], se=True),
            nn.Sequential(LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, 2)),
            ConvNeXtBlock(dims[1]))
        self.head_norm = nn.LayerNorm(dims[1])
        self.head = nn.Linear(dims[1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x)).mean((2, 3))
        return self.head(self.head_norm(x))


# --- the zoo ------------------------------------------------------------------------------------------------------
ARCHS: dict[str, Arch] = {
    "bert": Arch(_hf(tf.BertModel, tf.BertConfig, **TEXT), _ids, "last_hidden_state"),
    "distilbert": Arch(_hf(tf.DistilBertModel, tf.DistilBertConfig, vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                           hidden_dim=128, max_position_embeddings=64), _ids, "last_hidden_state"),
    "roberta": Arch(_hf(tf.RobertaModel, tf.RobertaConfig, **TEXT), _ids, "last_hidden_state"),
    "electra": Arch(_hf(tf.ElectraModel, tf.ElectraConfig, embedding_size=32, **TEXT), _ids, "last_hidden_state"),
    "albert": Arch(_hf(tf.AlbertModel, tf.AlbertConfig, embedding_size=32, **TEXT), _ids, "last_hidden_state"),
    "deberta_v2": Arch(_hf(tf.DebertaV2Model, tf.DebertaV2Config, relative_attention=True, position_buckets=16,
                           pos_att_type=["p2c", "c2p"], **TEXT), _ids, "last_hidden_state"),
    "modernbert": Arch(_hf(tf.ModernBertModel, tf.ModernBertConfig, global_attn_every_n_layers=2,
                           local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2, **TEXT), _ids, "last_hidden_state"),
    "t5_encoder": Arch(_hf(tf.T5EncoderModel, tf.T5Config, vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                           num_layers=2, num_heads=4), _ids, "last_hidden_state"),
    "gpt2": Arch(_hf(tf.GPT2LMHeadModel, tf.GPT2Config, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                     n_positions=64), _tokens),
    "opt": _decoder(tf.OPTForCausalLM, tf.OPTConfig, ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1),
    "llama": _decoder(tf.LlamaForCausalLM, tf.LlamaConfig, num_key_value_heads=2),
    "qwen2": _decoder(tf.Qwen2ForCausalLM, tf.Qwen2Config, num_key_value_heads=2),
    "qwen3": _decoder(tf.Qwen3ForCausalLM, tf.Qwen3Config, num_key_value_heads=2, head_dim=16),
    "mistral": _decoder(tf.MistralForCausalLM, tf.MistralConfig, num_key_value_heads=2, sliding_window=8),
    "phi3": _decoder(tf.Phi3ForCausalLM, tf.Phi3Config, num_key_value_heads=2, pad_token_id=0),
    "gemma": _decoder(tf.GemmaForCausalLM, tf.GemmaConfig, num_key_value_heads=2, head_dim=16),
    "gpt_neox": _decoder(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig),
    "falcon": _decoder(tf.FalconForCausalLM, tf.FalconConfig, new_decoder_architecture=True, num_kv_heads=2),
    "vit": Arch(_hf(tf.ViTForImageClassification, tf.ViTConfig, **VIT), _pixels),
    "deit": Arch(_hf(tf.DeiTForImageClassification, tf.DeiTConfig, **VIT), _pixels),
    "dinov2": Arch(_hf(tf.Dinov2ForImageClassification, tf.Dinov2Config, **VIT), _pixels),
    "swin": Arch(_hf(tf.SwinForImageClassification, tf.SwinConfig, image_size=32, patch_size=2, embed_dim=32,
                     depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=10), _pixels),
    "convnext": Arch(_hf(tf.ConvNextForImageClassification, tf.ConvNextConfig, num_stages=2, hidden_sizes=[32, 64],
                         depths=[1, 1], layer_scale_init_value=0.5, num_labels=10), _pixels),
    "mobilevit": Arch(_hf(tf.MobileViTForImageClassification, tf.MobileViTConfig, image_size=32, patch_size=2,
                          hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 128],
                          num_attention_heads=2, expand_ratio=2.0, num_labels=10), _pixels),
    "segformer": Arch(_hf(tf.SegformerForSemanticSegmentation, tf.SegformerConfig, num_encoder_blocks=2,
                          depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[32, 64], patch_sizes=[7, 3], strides=[4, 2],
                          num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=5),
                      _pixels),
    "resnet": Arch(_hf(tf.ResNetForImageClassification, tf.ResNetConfig, embedding_size=16, hidden_sizes=[16, 32],
                       depths=[1, 1], layer_type="basic", num_labels=10), _pixels),
    "wav2vec2": Arch(_hf(tf.Wav2Vec2Model, tf.Wav2Vec2Config, **SPEECH), _audio, "last_hidden_state"),
    "hubert": Arch(_hf(tf.HubertModel, tf.HubertConfig, **SPEECH), _audio, "last_hidden_state"),
    "whisper_encoder": Arch(_whisper_encoder, _mel, "last_hidden_state"),
    "whisper_decoder": Arch(_hf(tf.WhisperForConditionalGeneration, tf.WhisperConfig, **WHISPER), _mel_and_tokens),
    "efficientnet_style": Arch(lambda: _trained_batchnorm(EfficientNetStyle()).eval(), _image, 0),
    "convnext_timm_style": Arch(lambda: ConvNeXtTimmStyle().eval(), _image, 0),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ARCHS[name].build()


def batches(name: str, count: int, seed: int = 0) -> list[Inputs]:
    g = torch.Generator().manual_seed(seed)
    return [ARCHS[name].inputs(g) for _ in range(count)]


def positional(model: nn.Module, inputs: Inputs) -> tuple[Any, ...]:
    """Keyword inputs as the positional tuple ``prepare`` takes (None for the parameters in between)."""
    names = list(inspect.signature(model.forward).parameters)
    last = max(names.index(key) for key in inputs)
    return tuple(inputs.get(name) for name in names[: last + 1])


def main_output(name: str, output: Any) -> torch.Tensor:
    key = ARCHS[name].main
    if isinstance(key, int):
        return output if isinstance(output, torch.Tensor) else output[key]
    return getattr(output, key)

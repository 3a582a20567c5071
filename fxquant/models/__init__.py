"""The model zoo: float models that the quantization pipeline, the tests and the benchmarks run on.

Every model is built by a factory with keyword-only options, returns in eval mode (PTQ calibrates eval-mode
models; a forgotten ``.eval()`` silently changes BN and dropout), and comes with seeded example inputs. All trace
with ``torch.fx.symbolic_trace`` except the names in ``UNTRACEABLE``. Weights are random except for
:func:`train_digits_cnn`, the real-data example.

>>> model = create_model("resnet18", num_classes=10)
>>> model(*example_inputs("resnet18", batch_size=2)).shape
torch.Size([2, 10])
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from fxquant.errors import ConfigError
from fxquant.models import (
    audio1d,
    bert_style,
    control_flow,
    conv3d,
    convnet,
    digits,
    efficientnet,
    mlp,
    mobilenet,
    resnet,
    unet,
)
from fxquant.models.audio1d import audio1d_net
from fxquant.models.bert_style import bert_style_encoder
from fxquant.models.control_flow import control_flow_net
from fxquant.models.conv3d import conv3d_net
from fxquant.models.convnet import conv_bn_net
from fxquant.models.digits import DigitsCNN, accuracy, digits_cnn, digits_loader, load_digits_splits, train_digits_cnn
from fxquant.models.efficientnet import efficientnet_style
from fxquant.models.mlp import mlp as mlp_net
from fxquant.models.mobilenet import mobilenetv2_style
from fxquant.models.resnet import resnet18_style
from fxquant.models.unet import unet_style

# name -> (factory, the module defining INPUT_SHAPE and example_inputs for it)
_ENTRIES: dict[str, tuple[Callable[..., nn.Module], ModuleType]] = {
    "mlp": (mlp_net, mlp),
    "conv_bn": (conv_bn_net, convnet),
    "resnet18": (resnet18_style, resnet),
    "mobilenetv2": (mobilenetv2_style, mobilenet),
    "digits_cnn": (digits_cnn, digits),
    "bert_style": (bert_style_encoder, bert_style),
    "efficientnet": (efficientnet_style, efficientnet),
    "audio1d": (audio1d_net, audio1d),
    "conv3d": (conv3d_net, conv3d),
    "unet": (unet_style, unet),
    "control_flow": (control_flow_net, control_flow),
}

ZOO: dict[str, Callable[..., nn.Module]] = {name: factory for name, (factory, _) in _ENTRIES.items()}
"""Model name -> factory. Factories take keyword-only options and return a float model in eval mode."""

INPUT_SHAPES: dict[str, tuple[tuple[int, ...], ...]] = {
    name: (module.INPUT_SHAPE,) for name, (_, module) in _ENTRIES.items()
}
"""Model name -> per-sample shape of each default example input (no batch dimension)."""

UNTRACEABLE: frozenset[str] = frozenset({"control_flow"})
"""Models that whole-model ``torch.fx.symbolic_trace`` rejects on purpose (partial-tracing test cases)."""


def _entry(name: str) -> tuple[Callable[..., nn.Module], ModuleType]:
    if name not in _ENTRIES:
        near = difflib.get_close_matches(name, list(_ENTRIES), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"unknown zoo model {name!r}.{hint} Known: {', '.join(sorted(_ENTRIES))}.")
    return _ENTRIES[name]


def create_model(name: str, **options: object) -> nn.Module:
    """Build the zoo model ``name``; ``options`` go to its factory (e.g. ``num_classes=10``)."""
    return _entry(name)[0](**options)


def example_inputs(name: str, batch_size: int = 1, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded example inputs for the default configuration of ``name``: reproducible, global RNG untouched."""
    return _entry(name)[1].example_inputs(batch_size, seed=seed)


__all__ = [
    "INPUT_SHAPES",
    "UNTRACEABLE",
    "ZOO",
    "DigitsCNN",
    "accuracy",
    "audio1d_net",
    "bert_style_encoder",
    "control_flow_net",
    "conv3d_net",
    "conv_bn_net",
    "create_model",
    "digits_cnn",
    "digits_loader",
    "efficientnet_style",
    "example_inputs",
    "load_digits_splits",
    "mlp_net",
    "mobilenetv2_style",
    "resnet18_style",
    "train_digits_cnn",
    "unet_style",
]

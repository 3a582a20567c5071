"""Pieces shared by the zoo's models, so each architecture file only says how its blocks are arranged."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fxquant.errors import ConfigError

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)
_BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_NORM_TYPES = (*_BATCHNORM_TYPES, nn.LayerNorm)
# Inputs that settle BN statistics use their own seed, so they never coincide with default example inputs.
_SETTLE_SEED = 1234


def seeded_generator(seed: int) -> torch.Generator:
    """A private generator: example inputs are reproducible without touching the global RNG state."""
    return torch.Generator().manual_seed(seed)


def randn_batch(shape: tuple[int, ...], batch_size: int, seed: int) -> tuple[torch.Tensor]:
    """One seeded standard-normal input of ``(batch_size, *shape)``, as a 1-tuple like fx example inputs."""
    return (torch.randn(batch_size, *shape, generator=seeded_generator(seed)),)


def check_positive(where: str, **values: float) -> None:
    """Reject non-positive sizes up front: torch would fail later with a shape error far from the cause."""
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"{where}: {name} must be positive, got {value!r}")


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a scaled channel count to a multiple of ``divisor`` (as MobileNet/EfficientNet do) without losing >10%."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> optional activation: the unit BN folding and conv fusion look for.

    ``activation=None`` gives the linear bottleneck (projection) used by inverted residual blocks.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        *,
        stride: int = 1,
        groups: int = 1,
        activation: type[nn.Module] | None = nn.ReLU,
    ) -> None:
        padding = (kernel_size - 1) // 2
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        if activation is not None:
            layers.append(activation())
        super().__init__(*layers)


def init_weights(model: nn.Module, *, linear_std: float | None = None) -> None:
    """torchvision's initialisation, but Kaiming in ``fan_in`` mode, which preserves the forward activation scale.

    torchvision's ``fan_out`` counts every output channel of a depthwise conv, so a random MobileNetV2 shrinks its
    activations ~10x per stage (1e-9 at the head); quantization scales would then hit their epsilon clamp.
    """
    for module in model.modules():
        if isinstance(module, _CONV_TYPES):
            nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, _NORM_TYPES) and module.weight is not None:
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear) and linear_std is not None:
            nn.init.normal_(module.weight, 0.0, linear_std)
            nn.init.zeros_(module.bias)


@torch.no_grad()
def settle_batchnorm(model: nn.Module, input_shape: tuple[int, ...], batch_size: int = 4) -> None:
    """Set every BatchNorm's running statistics from one forward pass on seeded random inputs.

    In a trained network BN re-normalises each layer; with random weights and the default statistics (mean 0,
    var 1) activations drift instead (a random EfficientNet's sigmoid gates shrink them ~1000x by the head), and
    observers and SQNR measured on such a model describe tensors no real model produces.
    """
    norms = [module for module in model.modules() if isinstance(module, _BATCHNORM_TYPES)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average: one pass sets the statistics outright
    model.train()
    model(*randn_batch(input_shape, batch_size, _SETTLE_SEED))
    model.eval()
    for norm, momentum in zip(norms, momenta, strict=True):
        norm.momentum = momentum


class Conv2dStaticSamePadding(nn.Conv2d):
    """efficientnet_pytorch's 'same' padding for a fixed image size: a ZeroPad2d child, then F.conv2d on its own
    weight."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1,
                 image_size: int = 32, bias: bool = False) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias)
        out = math.ceil(image_size / stride)
        pad = max((out - 1) * stride + kernel_size - image_size, 0)
        self.static_padding = nn.ZeroPad2d((pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.static_padding(x)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

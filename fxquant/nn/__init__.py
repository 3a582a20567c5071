"""Float fused modules and the INT8 modules that replace them."""

from fxquant.nn.fused import Fused, add_relu
from fxquant.nn.quantized import (
    DeQuantize,
    Quantize,
    QuantizedAdd,
    QuantizedAvgPool,
    QuantizedConv1d,
    QuantizedConv2d,
    QuantizedConv3d,
    QuantizedConvNd,
    QuantizedLinear,
    QuantizedReLU,
)

__all__ = [
    "DeQuantize",
    "Fused",
    "Quantize",
    "QuantizedAdd",
    "QuantizedAvgPool",
    "QuantizedConv1d",
    "QuantizedConv2d",
    "QuantizedConv3d",
    "QuantizedConvNd",
    "QuantizedLinear",
    "QuantizedReLU",
    "add_relu",
]

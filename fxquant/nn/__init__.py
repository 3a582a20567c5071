"""Float fused modules and the INT8 modules that replace them."""

from fxquant.nn.fused import Fused, add_relu
from fxquant.nn.lookup import QuantizedLookup
from fxquant.nn.quantized import (
    DeQuantize,
    Quantize,
    QuantizedAdd,
    QuantizedCat,
    QuantizedConv1d,
    QuantizedConv2d,
    QuantizedConv3d,
    QuantizedConvAdd2d,
    QuantizedConvNd,
    QuantizedConvTranspose1d,
    QuantizedConvTranspose2d,
    QuantizedLinear,
    QuantizedMul,
    QuantizedPool,
    QuantizedReLU,
)
from fxquant.nn.schemes import (
    DynamicGroupInt8Linear,
    DynamicInt8Linear,
    SchemeLinear,
    StaticOutliersInt8Linear,
    WeightOnlyInt8Linear,
)
from fxquant.nn.tied_embedding import TiedInt8Embedding

__all__ = [
    "DeQuantize",
    "DynamicGroupInt8Linear",
    "DynamicInt8Linear",
    "Fused",
    "Quantize",
    "QuantizedAdd",
    "QuantizedPool",
    "QuantizedConv1d",
    "QuantizedConv2d",
    "QuantizedConv3d",
    "QuantizedConvAdd2d",
    "QuantizedConvNd",
    "QuantizedConvTranspose1d",
    "QuantizedConvTranspose2d",
    "QuantizedCat",
    "QuantizedMul",
    "QuantizedLinear",
    "QuantizedLookup",
    "QuantizedReLU",
    "SchemeLinear",
    "StaticOutliersInt8Linear",
    "TiedInt8Embedding",
    "WeightOnlyInt8Linear",
    "add_relu",
]

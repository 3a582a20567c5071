"""torch's quantized engines: the engine switch and the quantized-dtype tensors their kernels take.

This is the one module of fxquant that makes, reads or converts quantized-dtype tensors (``quint8``/``qint8``/
``qint32``) and sets the process-wide ``torch.backends.quantized.engine``; the fbgemm and qnnpack backends
(:mod:`fxquant.kernels.torch_engines.backends`) and the C loops that compute their bytes pass those tensors on to the
engines' kernels. torch 2.13 deprecates those dtypes (pytorch issue 184982): users of the two backends are told once
(:func:`note_deprecation`), and torch's per-call warning is silenced. The engine is switched only while weights are
prepacked (a packed weight remembers its engine), then restored.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from fxquant.qparams import QParams

log = logging.getLogger(__name__)
_TOLD = False
_DEPRECATION = r".*quantized tensor creation functions.*deprecated.*"


def note_deprecation() -> None:
    """Tell the user once that these backends use deprecated dtypes, and silence torch's warning on every call."""
    global _TOLD
    if not _TOLD:
        _TOLD = True
        warnings.filterwarnings("ignore", message=_DEPRECATION)
        log.warning(
            "note: fxquant's fbgemm/qnnpack backends use torch's quantized dtypes, which torch 2.13 deprecates "
            "(pytorch issue 184982); the 'onednn' and 'reference' backends do not use them."
        )


@contextlib.contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """Set ``torch.backends.quantized.engine`` for the block and restore it afterwards."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def has_engine(name: str) -> bool:
    """Whether this torch build has the quantized engine ``name``."""
    return name in torch.backends.quantized.supported_engines


def prepack_weight(engine: str, prepack: Any, weight: torch.Tensor, w_qp: QParams, *args: Any) -> Any:
    """``prepack(quantized weight, *args)`` under ``engine``: the int8 ``weight`` as a ``qint8`` tensor on ``w_qp``."""
    with quantized_engine(engine):
        return prepack(_weight_tensor(weight, w_qp), *args)


def _weight_tensor(weight: torch.Tensor, w_qp: QParams) -> torch.Tensor:
    if w_qp.axis is None:
        scale, zp = w_qp.scalar()
        return torch._make_per_tensor_quantized_tensor(weight, scale, zp)
    return torch._make_per_channel_quantized_tensor(
        weight, w_qp.scale.double(), w_qp.zero_point, w_qp.axis
    )


def unpacked_linear(payload: Any) -> tuple[torch.Tensor, QParams, torch.Tensor | None]:
    """A packed Linear's int8 weight (a plain tensor), its qparams and its bias."""
    weight, bias = payload.unpack()
    if weight.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        scale, zero_point = weight.q_per_channel_scales().float(), weight.q_per_channel_zero_points()
        w_qp = QParams(scale, zero_point, -128, 127, axis=0)
    else:
        w_qp = QParams(torch.tensor(weight.q_scale()), torch.tensor(weight.q_zero_point()), -128, 127)
    return weight.int_repr(), w_qp, bias


def quantize_quint8(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    return torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)


def dequantized(a: torch.Tensor) -> torch.Tensor:
    return a.dequantize()


def quint8_from_bytes(stored: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """Stored uint8 values as a ``quint8`` tensor with that scale and zero point (no copy)."""
    return torch._make_per_tensor_quantized_tensor(stored, scale, zero_point)


def bytes_of(a: torch.Tensor) -> torch.Tensor:
    """A quantized tensor's stored integers, as a plain tensor."""
    return a.int_repr()


def stored_integers(a: torch.Tensor) -> torch.Tensor:
    """``a``'s stored integers: a quantized tensor's, or a plain integer tensor as it is."""
    return a.int_repr() if a.is_quantized else a


def is_quint8(a: torch.Tensor) -> bool:
    return a.dtype == torch.quint8


def grid(a: torch.Tensor) -> tuple[float, int]:
    """A per-tensor quantized tensor's scale and zero point."""
    return a.q_scale(), a.q_zero_point()


def empty_quantized(shape: list[int] | torch.Size, scale: float, zero_point: int, *, dtype: torch.dtype = torch.quint8,
                    memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """An uninitialized quantized tensor (``quint8`` unless told) for a kernel or C loop to write into."""
    return torch._empty_affine_quantized(shape, scale=scale, zero_point=zero_point, dtype=dtype,
                                         memory_format=memory_format)


def int32_bias(bias: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``bias`` rounded to int32 multiples of ``steps`` (one per output channel), as torch's ``quantize_per_channel``
    rounds it: qnnpack's own ``QuantizeBias``."""
    zeros = torch.zeros_like(steps, dtype=torch.int32)
    return torch.quantize_per_channel(bias, steps, zeros, 0, torch.qint32).int_repr()

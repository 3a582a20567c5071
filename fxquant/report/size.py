"""Model size as users pay for it: the bytes of the serialized state dict."""

from __future__ import annotations

import io

import torch
from torch import nn


def serialized_size(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())`` (weights, int8 weights and qparams; no code, no observers)."""
    buffer = io.BytesIO()
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(state, buffer)
    return buffer.getbuffer().nbytes

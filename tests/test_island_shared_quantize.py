"""``SharedQuantize``: the one input quantize of sibling islands reading one value must give every reader exactly
what its own quantize would have given, whatever the readers pass."""

from __future__ import annotations

import pytest
import torch

from fxquant.kernels.registry import available_backends, get_backend
from fxquant.nn.shared_quantize import SharedQuantize
from fxquant.qparams import affine_qparams


@pytest.mark.parametrize("name", available_backends())
def test_a_repeated_read_reuses_and_anything_else_is_quantized_afresh(name: str) -> None:
    backend = get_backend(name)
    qp = affine_qparams(torch.tensor(-3.0), torch.tensor(3.0))
    shared = SharedQuantize(qp, backend)
    x = torch.randn(4, 8)

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return backend.dequantize(backend.quantize(t, qp), qp)

    first = shared(x)
    assert shared(x) is first  # the second reader of the same, unchanged tensor gets the same int8 tensor
    copy = x.clone()
    assert shared(copy) is not first and torch.equal(backend.dequantize(shared(copy), qp), fresh(x))
    x.mul_(0.5)  # changed in place: its version counter moves, so it is quantized again
    assert torch.equal(backend.dequantize(shared(x), qp), fresh(x))
    again = shared(x)
    shared.reset()  # the parent block's next call
    assert shared(x) is not again


def test_inference_tensors_are_shared_by_identity() -> None:
    backend = get_backend("reference")
    shared = SharedQuantize(affine_qparams(torch.tensor(-1.0), torch.tensor(1.0)), backend)
    with torch.inference_mode():
        x = torch.randn(3)
        first = shared(x)
        assert shared(x) is first
        assert shared(torch.randn(3)) is not first

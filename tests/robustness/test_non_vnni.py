"""CPUs without VNNI: fbgemm (and oneDNN) sum pairs of u8*s8 products in 16 bits, so activations get 7 bits.

``FXQUANT_ISA=avx512`` forces that path on any machine. Why the 7 bits exist (fbgemm's depthwise kernel
saturating with full-range inputs) is pinned in tests/kernels/test_fbgemm_qnnpack_pitfalls.py and not repeated.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from strategies import quantized_linear
from torch import nn

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.native.isa import has_vnni
from fxquant.testing import simulate

SEVEN_BITS = [b for b in ("fbgemm", "onednn") if b in available_backends()]


class _Net(nn.Module):
    """A plain conv, a depthwise conv, a residual add and a Linear: every activation an int8 kernel reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(torch.flatten(y + self.dw(y), 1))


def _activation_qparams(qmodel: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """(qmin, qmax) of every int8 value the converted model produces, by module path."""
    found = {}
    for path, module in qmodel.named_modules():
        for attr in ("qp", "out_qp"):
            qp = getattr(module, attr, None)
            if qp is not None:
                found[f"{path}.{attr}"] = (qp.qmin, qp.qmax)
    return found


def _int8_outputs(qmodel: torch.fx.GraphModule, x: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Every quantized-dtype or uint8 tensor a module of ``qmodel`` returns while running ``x``."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [module.register_forward_hook(lambda m, args, out, path=path: seen.append((path, out)))
             for path, module in qmodel.named_modules() if path]
    try:
        qmodel(x)
    finally:
        for hook in hooks:
            hook.remove()
    for path, out in seen:
        if isinstance(out, torch.Tensor) and (out.is_quantized or out.dtype == torch.uint8):
            yield path, out.int_repr() if out.is_quantized else out


@pytest.fixture
def calibrated() -> torch.fx.GraphModule:
    prepared = fxquant.prepare(_Net().eval(), (torch.randn(2, 3, 6, 6),))
    fxquant.calibrate(prepared, [torch.randn(8, 3, 6, 6) for _ in range(3)], progress=False)
    return prepared


@pytest.mark.parametrize("backend", SEVEN_BITS)
def test_without_vnni_every_activation_is_seven_bit_and_matches_the_simulation(
        backend: str, calibrated: torch.fx.GraphModule, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXQUANT_ISA", "avx512")
    assert not has_vnni()
    qmodel = fxquant.convert(calibrated, backend=backend)
    ranges = _activation_qparams(qmodel)
    assert ranges and all(r == (0, 127) for r in ranges.values()), ranges
    fake = simulate(calibrated, backend)
    for gain in (1.0, 50.0):  # also far beyond the calibrated range, where only a clamp keeps values in 7 bits
        x = torch.randn(4, 3, 6, 6) * gain
        step = float(quantized_linear(qmodel, "fc").out_qp.scale)
        error = float((qmodel(x) - fake(x)).abs().max()) / step
        assert error <= 1.0 + 1e-4, f"{backend} without VNNI, inputs x{gain}: {error:.2f} steps from the simulation"
        for path, values in _int8_outputs(qmodel, x):
            assert int(values.max()) <= 127, f"{backend}: {path} produced {int(values.max())} > 127 without VNNI"


@pytest.mark.skipif(not has_vnni() or "fbgemm" not in available_backends(), reason="needs VNNI and fbgemm")
def test_with_vnni_only_grouped_conv_inputs_are_seven_bit_on_fbgemm(calibrated: torch.fx.GraphModule) -> None:
    """The forced path above is a real switch: on this VNNI machine the same model keeps 8 bits elsewhere."""
    ranges = _activation_qparams(fxquant.convert(calibrated, backend="fbgemm"))
    assert ranges["conv.out_qp"] == (0, 127), ranges  # it feeds the depthwise conv
    assert ranges["fc.out_qp"] == (0, 255), ranges

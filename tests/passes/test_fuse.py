"""fuse_activations: Linear/Conv + ReLU/ReLU6/hardtanh become one Fused unit; add + ReLU becomes add_relu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxquant.nn import Fused, add_relu
from fxquant.passes import fuse_activations


class ConvAct(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(3, 4, 3), act
        self.relu6 = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if self.act == "module":
            return self.relu6(y)
        if self.act == "functional":
            return F.relu(y, inplace=True)
        if self.act == "method":
            return y.relu()
        return F.hardtanh(y, -1.0, 1.0)


@pytest.mark.parametrize(("act", "name"), [("module", "relu6"), ("functional", "relu"), ("method", "relu"),
                                           ("hardtanh", "hardtanh(-1.0, 1.0)")])
def test_conv_activation_fused(act: str, name: str) -> None:
    model = ConvAct(act).eval()
    gm = fuse_activations(fx.symbolic_trace(model))
    ops = [n.op for n in gm.graph.nodes]
    assert ops == ["placeholder", "call_module", "output"], ops
    assert isinstance(gm.conv, Fused) and gm.conv.activation == name
    x = torch.randn(2, 3, 8, 8) * 4
    torch.testing.assert_close(gm(x), model(x))


def test_add_relu_fused_and_clamp_excluding_zero_is_not() -> None:
    class Residual(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu(a + b), F.hardtanh(a, 0.5, 1.0)

    gm = fuse_activations(fx.symbolic_trace(Residual()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert add_relu in targets and F.hardtanh in targets
    a, b = torch.randn(4), torch.randn(4)
    for got, want in zip(gm(a, b), Residual()(a, b), strict=True):
        torch.testing.assert_close(got, want)

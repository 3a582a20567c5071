"""fold_batchnorm: BN nodes disappear and the graph computes the same function."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from fxquant.passes import fold_batchnorm


def _randomise_bn(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


@pytest.mark.parametrize(("layers", "shape"), [
    ((nn.Conv1d(3, 8, 3), nn.BatchNorm1d(8)), (2, 3, 16)),
    ((nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)), (2, 3, 8, 8)),
    ((nn.Conv3d(3, 8, 3), nn.BatchNorm3d(8)), (2, 3, 6, 6, 6)),
    ((nn.Linear(5, 8), nn.BatchNorm1d(8)), (4, 5)),
])
def test_fold_removes_bn_and_keeps_function(layers: tuple[nn.Module, ...], shape: tuple[int, ...]) -> None:
    model = _randomise_bn(nn.Sequential(*layers))
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(torch.randn(*shape))  # what prepare records: a Linear's output rank decides folding
    gm = fold_batchnorm(gm)
    kinds = [type(m) for m in gm.modules()]
    assert not any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in kinds)
    assert len([n for n in gm.graph.nodes if n.op == "call_module"]) == 1
    x = torch.randn(*shape)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_bn_after_shared_conv_is_not_folded() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y  # the conv output is needed unnormalised too

    model = _randomise_bn(Shared())
    gm = fold_batchnorm(fx.symbolic_trace(model))
    assert any(isinstance(m, nn.BatchNorm2d) for m in gm.modules())
    x = torch.randn(1, 3, 4, 4)
    torch.testing.assert_close(gm(x), model(x))


def test_bn_after_a_linear_on_3d_input_is_not_folded_along_the_wrong_axis() -> None:
    """Found by generated-model testing: BatchNorm1d normalizes dim 1, a Linear's features are the last dim."""
    model = _randomise_bn(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)))
    x = torch.randn(2, 4, 6)
    gm = fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    gm = fold_batchnorm(gm)
    assert any(isinstance(m, nn.BatchNorm1d) for m in gm.modules())
    torch.testing.assert_close(gm(x), model(x))


def test_two_batchnorms_in_a_row_both_fold() -> None:
    """Found by generated-model testing: the second fold started from the unfolded layer."""
    model = _randomise_bn(nn.Sequential(nn.Conv1d(2, 3, 1), nn.BatchNorm1d(3), nn.BatchNorm1d(3)))
    x = torch.randn(4, 2, 5)
    gm = fold_batchnorm(fx.symbolic_trace(model))
    assert not any(isinstance(m, nn.BatchNorm1d) for m in gm.modules())
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)

"""Cross-layer equalization: exact float function, the Nagel et al. scales, which pairs it touches, SQNR gain."""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

import fxquant
from fxquant import QuantConfig
from fxquant.models import create_model
from fxquant.passes import equalize_layers, fold_batchnorm, fuse_activations
from fxquant.passes.equalize import equalizable_pairs
from fxquant.qparams import sqnr_db


def _fused_graph(model: nn.Module) -> fx.GraphModule:
    return fuse_activations(fold_batchnorm(fx.symbolic_trace(copy.deepcopy(model))))


class LinearPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class DepthwiseChain(nn.Module):
    """expand (ReLU) -> depthwise (ReLU) -> project, plus a ReLU6 pair and a branching layer that must be skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 8, 1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.project = nn.Conv2d(8, 4, 1)
        self.clamped = nn.Conv2d(4, 4, 1)
        self.relu6 = nn.ReLU6()
        self.after_clamp = nn.Conv2d(4, 4, 1)
        self.branch = nn.Conv2d(4, 4, 1)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(torch.relu(self.depthwise(torch.relu(self.expand(x)))))
        y = self.after_clamp(self.relu6(self.clamped(y)))
        b = self.branch(y)
        return self.head(b) + b


def test_scales_match_the_reference_formula() -> None:
    model = LinearPair().eval()
    gm = _fused_graph(model)
    w1, b1, w2 = model.fc1.weight.detach(), model.fc1.bias.detach(), model.fc2.weight.detach()
    r1, r2 = w1.abs().amax(dim=1), w2.abs().amax(dim=0)
    s = torch.sqrt(r1 * r2) / r2  # Nagel et al. eq. (10)
    equalize_layers(gm, QuantConfig(equalize=True))
    fc1, fc2 = gm.get_submodule("fc1").inner, gm.get_submodule("fc2")
    torch.testing.assert_close(fc1.weight, w1 / s[:, None])
    torch.testing.assert_close(fc1.bias, b1 / s)
    torch.testing.assert_close(fc2.weight, w2 * s[None, :])
    torch.testing.assert_close(fc1.weight.abs().amax(dim=1), fc2.weight.abs().amax(dim=0))  # balanced


def test_float_output_unchanged_and_only_exact_pairs_found() -> None:
    model = DepthwiseChain().eval()
    x = torch.randn(2, 3, 8, 8)
    gm = _fused_graph(model)
    pairs = equalizable_pairs(gm)
    # clamped -> after_clamp goes through ReLU6 and branch has two readers: neither may be rescaled
    assert pairs == [("expand", "depthwise"), ("depthwise", "project"), ("project", "clamped"),
                     ("after_clamp", "branch")], pairs
    equalize_layers(gm, QuantConfig(equalize=True))
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    depthwise = gm.get_submodule("depthwise").inner
    project = gm.get_submodule("project")
    ratio = depthwise.weight.abs().flatten(1).amax(dim=1) / project.weight.abs().amax(dim=(0, 2, 3))
    assert float((ratio - 1).abs().max()) < 1e-2, ratio  # swept until the chain settles


def test_prepare_keeps_the_float_function() -> None:
    model = DepthwiseChain().eval()
    x = torch.randn(2, 3, 8, 8)
    prepared = fxquant.prepare(model, (x,), QuantConfig(equalize=True))
    torch.testing.assert_close(prepared(x), model(x), rtol=1e-5, atol=1e-5)


def test_equalization_rescues_per_tensor_weights() -> None:
    model = LinearPair()
    model.fc1, model.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
    with torch.no_grad():  # 4 hidden channels 50x larger, compensated after the ReLU: same float function
        model.fc1.weight[:4] *= 50
        model.fc1.bias[:4] *= 50
        model.fc2.weight[:, :4] /= 50
    model.eval()
    data = [torch.randn(32, 16) for _ in range(4)]
    x = torch.randn(64, 16)
    measured = {}
    for equalize in (False, True):
        qmodel = fxquant.quantize(model, (x,), data, QuantConfig(weight="per_tensor", equalize=equalize),
                                  progress=False)
        measured[equalize] = sqnr_db(model(x), qmodel(x))
    gain = measured[True] - measured[False]
    assert gain >= 6.0, f"CLE gain {gain:.2f} dB ({measured[False]:.2f} -> {measured[True]:.2f} dB)"


def test_equalization_on_unbalanced_depthwise_mobilenet() -> None:
    """Shallow MobileNetV2 (ReLU: equalization skips ReLU6), a quarter of each depthwise channel 50x larger."""
    model = create_model("mobilenetv2", num_classes=10, settings=((1, 16, 1, 1), (6, 24, 2, 2)))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.ReLU6):
                setattr(module, name, nn.ReLU())
    with torch.no_grad():
        for block in model.features[1:-1]:
            bn, project = block.conv[-2][1], block.conv[-1][0]
            bn.weight[::4] *= 50
            bn.bias[::4] *= 50
            project.weight[:, ::4] /= 50
    data = [torch.randn(4, 3, 32, 32) for _ in range(3)]
    x = torch.randn(8, 3, 32, 32)
    measured = {}
    for equalize in (False, True):
        config = QuantConfig(weight="per_tensor", equalize=equalize, bias_correction=equalize)
        measured[equalize] = sqnr_db(model(x), fxquant.quantize(model, (x,), data, config, progress=False)(x))
    assert measured[True] - measured[False] >= 6.0, f"per_tensor -> + CLE + bias correction: {measured} dB"

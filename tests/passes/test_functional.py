"""``functional_to_modules``: ``F.linear``/``F.convNd`` on a module's own parameters become module calls that fold,
fuse and quantize, without losing anything else the graph reads from that module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

import fxquant
from fxquant.models._blocks import Conv2dStaticSamePadding
from fxquant.passes.functional import functional_to_modules
from fxquant.testing import assert_sqnr
from fxquant.tracing import trace

FLOOR = 42.0  # dB; measured 45.3 (reference backend, these seeds)


class PlainLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = Conv2dStaticSamePadding(3, 8, 3, stride=2, image_size=16, bias=True)
        self.head = PlainLinear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(torch.relu(self.stem(x)), 1).flatten(1))


def _functional_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.conv2d, F.linear)]


def test_a_padding_child_survives_and_the_conv_becomes_a_module_under_its_owner() -> None:
    model = Net().eval()
    gm = functional_to_modules(trace(model))
    assert not _functional_calls(gm)
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert called == ["stem.static_padding", "stem.conv2d", "head"], called
    assert isinstance(gm.get_submodule("stem.static_padding"), nn.ZeroPad2d)
    assert type(gm.get_submodule("head")) is nn.Linear  # nothing else read from it: the module takes its place
    assert gm.get_submodule("stem.conv2d").weight is gm.get_submodule("stem").weight  # the user's parameters
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(gm(x), model(x))


def test_the_same_padding_model_quantizes_every_layer() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    data = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    prepared = fxquant.prepare(model, (data[0],), fxquant.QuantConfig(backend="reference"))
    assert torch.equal(prepared(data[0]), model(data[0]))
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared)
    rows = {row.path: row.quantized for row in fxquant.coverage(qmodel).layers}
    assert rows == {"stem.conv2d": True, "head": True}, fxquant.coverage(qmodel)
    assert not hasattr(model.stem, "conv2d")  # the user's model is untouched
    x = torch.randn(4, 3, 16, 16)
    assert_sqnr(model(x), qmodel(x), FLOOR)

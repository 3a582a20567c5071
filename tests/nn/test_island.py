"""An INT8 island answers for the module it replaced: what the user's code reads keeps working (ViT reads
``projection.weight.dtype``, Whisper reads ``conv.stride``); a read it cannot answer is one clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxquant
from fxquant.errors import TraceError
from fxquant.nn.island import Island
from fxquant.nn.quantized import _QuantizedWeighted


class PatchEmbed(nn.Module):
    """ViT's patch embedding: the channel check on a shape does not trace."""

    def __init__(self) -> None:
        super().__init__()
        self.num_channels = 3
        self.proj = nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.proj.hint = torch.tensor(1.0)  # a tensor attribute, neither parameter nor buffer: islands do not keep it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.num_channels:
            raise ValueError("channels")
        return self.proj(x).flatten(2).transpose(1, 2)


class Net(nn.Module):
    def __init__(self, extra_read: str = "") -> None:
        super().__init__()
        self.extra_read = extra_read
        self.patch = PatchEmbed()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.patch.proj.weight.dtype)  # as ViTModel.forward does
        steps = self.patch.proj.stride[0] * self.patch.proj.kernel_size[1]  # as Whisper reads its convs
        if self.extra_read:
            x = x * getattr(self.patch.proj, self.extra_read)
        return self.head(self.patch(x)).mean(1) * steps


def _quantized(model: nn.Module, *, bias_correction: bool = True) -> nn.Module:
    torch.manual_seed(0)
    data = [torch.randn(2, 3, 16, 16) for _ in range(4)]
    config = fxquant.QuantConfig(backend="reference", bias_correction=bias_correction)
    return fxquant.quantize(model, (data[0],), data, config, progress=False)


def test_the_island_keeps_attributes_and_a_float_weight() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    qmodel = _quantized(model, bias_correction=False)  # the float bias, exactly (not moved by bias correction)
    island = qmodel.get_submodule("patch.proj")
    assert isinstance(island, Island)
    assert (island.stride, island.kernel_size, island.in_channels) == ((4, 4), (4, 4), 3)
    layer = next(m for m in island.modules() if isinstance(m, _QuantizedWeighted))
    weight = island.weight
    assert weight.dtype == torch.float32 and weight.shape == model.patch.proj.weight.shape
    # the int8 weight, dequantized: within half a step of each output channel's grid of the float weight, not equal
    float_weight = model.patch.proj.weight.detach()
    half_step = layer.w_qp.scale.reshape(-1, 1, 1, 1) / 2
    assert bool(((weight - float_weight).abs() <= half_step * (1 + 1e-4)).all())  # float rounding at a tie
    assert not torch.equal(weight, float_weight)
    assert torch.equal(island.bias, model.patch.proj.bias.detach())
    assert copy.deepcopy(island).stride == (4, 4)  # convert deep-copies: the surface must survive it
    assert fxquant.coverage(qmodel).quantized_fraction == 1.0


def test_a_read_the_island_cannot_answer_names_the_island_the_line_and_the_fix() -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError) as caught:
        _quantized(Net(extra_read="hint").eval())
    message = str(caught.value)
    assert "'patch.proj' runs as an fxquant INT8 island" in message and "not 'hint'" in message, message
    assert "QuantConfig(exclude=['patch.proj'])" in message, message
    assert "test_island.py:" in message, message  # the user's line (through torch.fx's generated code)


def test_the_fix_the_message_gives_works() -> None:
    torch.manual_seed(0)
    model = Net(extra_read="hint").eval()
    data = [torch.randn(2, 3, 16, 16) for _ in range(4)]
    config = fxquant.QuantConfig(backend="reference", exclude=["patch.proj"])
    qmodel = fxquant.quantize(model, (data[0],), data, config, progress=False)
    rows = {row.path: row.quantized for row in fxquant.coverage(qmodel).layers}
    assert rows == {"patch.proj": False, "head": True}, fxquant.coverage(qmodel)
    assert torch.equal(qmodel.get_submodule("patch.proj").hint, model.patch.proj.hint)

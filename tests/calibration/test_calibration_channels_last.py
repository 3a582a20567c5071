"""Calibration with channels-last Conv2d weights (fxquant.calibration.memory_format).

Checked against the same calibration in NCHW memory (the reference): the observers' ranges agree to float rounding,
the weights the user's model had are back after the block, and a model whose code needs NCHW memory is detected at
prepare time and calibrates in NCHW instead of failing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.calibration import observers_of
from fxquant.state import quant_state, update_state


class ConvNet(nn.Module):
    def __init__(self, flatten_by_view: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.fc = nn.Linear(8 * 6 * 6, 4)
        self.flatten_by_view = flatten_by_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(torch.relu(self.bn(self.conv1(x))))
        y = torch.relu(y + 1.0)
        flat = y.view(y.size(0), -1) if self.flatten_by_view else torch.flatten(y, 1)  # view: NCHW memory only
        return self.fc(flat)


def data(batches: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, 6, 6, generator=generator) for _ in range(batches)]


def prepared_net(flatten_by_view: bool = False) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = ConvNet(flatten_by_view).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return fxquant.prepare(model, (data(1)[0],))


def ranges(prepared: torch.fx.GraphModule) -> dict[str, tuple[float, float]]:
    return {name: (float(obs.min_val), float(obs.max_val)) for name, obs in observers_of(prepared).items()}


def test_conv_model_calibrates_channels_last_with_the_nchw_ranges() -> None:
    prepared = prepared_net()
    assert quant_state(prepared).channels_last
    reference = prepared_net()
    update_state(reference, channels_last=False)
    weights = {name: (p, p.data_ptr()) for name, p in prepared.named_parameters()}
    seen = []
    with fxquant.observing(prepared):
        conv = prepared.get_submodule("conv1")
        inner = conv.inner if hasattr(conv, "inner") else conv
        seen.append(inner.weight.is_contiguous(memory_format=torch.channels_last) and not inner.weight.is_contiguous())
        for x in data():
            prepared(x)
    with fxquant.observing(reference):
        for x in data():
            reference(x)
    assert seen == [True]
    mine, theirs = ranges(prepared), ranges(reference)
    assert mine.keys() == theirs.keys()
    for name, (lo, hi) in mine.items():
        assert lo == pytest.approx(theirs[name][0], rel=1e-5, abs=1e-5), name
        assert hi == pytest.approx(theirs[name][1], rel=1e-5, abs=1e-5), name
    for name, p in prepared.named_parameters():  # the same tensors, in their own layout, after the block
        assert p is weights[name][0] and p.data_ptr() == weights[name][1] and p.is_contiguous(), name


def test_a_model_that_needs_nchw_memory_calibrates_in_nchw() -> None:
    prepared = prepared_net(flatten_by_view=True)
    assert not quant_state(prepared).channels_last
    summary = fxquant.calibrate(prepared, data(), progress=False)
    assert summary.batches == 3
    qmodel = fxquant.convert(prepared, backend="reference")
    assert qmodel(data(1)[0]).shape == (4, 4)


def test_models_without_conv2d_do_not_switch() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)).eval()
    assert not quant_state(fxquant.prepare(model, (torch.randn(2, 6),))).channels_last


def test_weights_come_back_when_the_block_raises_and_under_inference_mode() -> None:
    prepared = prepared_net()
    before = [p.data_ptr() for p in prepared.parameters()]
    with pytest.raises(RuntimeError, match="stop"), torch.inference_mode(), fxquant.observing(prepared):
        prepared(data(1)[0])
        raise RuntimeError("stop")
    assert [p.data_ptr() for p in prepared.parameters()] == before
    assert all(p.is_contiguous() for p in prepared.parameters())
    prepared(data(1)[0])  # still runs outside the block, NCHW

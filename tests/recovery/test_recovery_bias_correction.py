"""Bias correction: the mean input window and the corrected biases against a direct computation on the data."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.api import apply_statistics
from fxquant.passes import InputMeanObserver
from fxquant.passes.bias_correction import SAMPLE_VALUES, Window, bias_shift, window_sums
from fxquant.qparams import sqnr_db


def _per_tensor_fake_quant(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per tensor, written out: scale = max|w| / 127.5, round half to even, clamp to [-128, 127]."""
    scale = weight.abs().max() / 127.5
    return torch.clamp(torch.round(weight / scale), -128, 127) * scale


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "float64"])
@pytest.mark.parametrize("conv", [
    nn.Conv2d(4, 6, 3, padding=1, stride=2),
    nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4, padding_mode="reflect"),
    nn.Conv2d(4, 6, (2, 3), padding="same", groups=2),
    nn.Conv2d(4, 6, 1),
    nn.Conv1d(4, 6, 5, padding=2, stride=3),
    nn.Conv1d(4, 6, 4, padding=3, padding_mode="circular"),
    nn.Conv3d(4, 2, (1, 3, 2), stride=(1, 2, 1), padding=(0, 1, 1), padding_mode="replicate"),
], ids=["strided", "dilated-reflect", "same-even", "1x1", "conv1d-strided", "conv1d-circular", "conv3d-replicate"])
def test_mean_window_gives_the_mean_output(conv: nn.modules.conv._ConvNd, layout: str) -> None:
    dims = (9,) * (conv.weight.dim() - 2)
    batches = [torch.randn(3, 4, *dims) + 0.5 for _ in range(2)]
    if layout == "channels_last" and conv.weight.dim() > 3:
        memory = torch.channels_last if conv.weight.dim() == 4 else torch.channels_last_3d
        batches = [x.contiguous(memory_format=memory) for x in batches]
    observer = InputMeanObserver(conv)
    for x in batches:
        observer(x.double() if layout == "float64" else x)  # its sums are float64 whatever it reads
    weight = torch.randn_like(conv.weight)
    reference = copy.deepcopy(conv)
    reference.weight.data, reference.bias = weight, None
    outputs = torch.cat([reference(x).transpose(0, 1).reshape(weight.shape[0], -1) for x in batches], dim=1)
    torch.testing.assert_close(bias_shift(conv, weight, observer.mean()), outputs.mean(dim=1), rtol=1e-4, atol=1e-5)
    _, count = window_sums(batches[0], Window.of(conv))
    assert count == reference(batches[0])[:, 0].numel()  # samples x output positions


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.depthwise(torch.relu(self.conv(x)))), 1))


def test_corrected_biases_match_the_mean_shift_on_the_data() -> None:
    model = ConvNet().eval()
    with torch.no_grad():
        model.depthwise.weight[:2] *= 30  # per-tensor rounding now zeroes most depthwise channels
    data = [torch.rand(4, 3, 6, 6) for _ in range(3)]
    config = QuantConfig(weight="per_tensor", bias_correction=True)
    prepared = fxquant.prepare(model, (data[0],), config)
    fxquant.calibrate(prepared, data, progress=False)
    corrected = apply_statistics(prepared)

    inputs: dict[str, list[torch.Tensor]] = {"conv": [], "depthwise": [], "fc": []}
    hooks = [getattr(model, name).register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0]))
             for name in inputs]
    with torch.no_grad():
        for x in data:
            model(x)
    for hook in hooks:
        hook.remove()
    for name, seen in inputs.items():
        layer = getattr(model, name)
        error = layer.weight.detach() - _per_tensor_fake_quant(layer.weight.detach())
        with torch.no_grad():
            if isinstance(layer, nn.Linear):
                shift = torch.cat([F.linear(x, error) for x in seen]).mean(dim=0)
            else:
                outputs = [F.conv2d(x, error, padding=1, groups=layer.groups) for x in seen]
                shift = torch.cat(outputs).mean(dim=(0, 2, 3))
        new_bias = corrected.get_submodule(name)
        new_bias = getattr(new_bias, "inner", new_bias).bias
        torch.testing.assert_close(new_bias - layer.bias, shift, rtol=1e-3, atol=1e-5, msg=f"{name}")


def test_bias_correction_reduces_the_error() -> None:
    model = ConvNet().eval()
    with torch.no_grad():
        model.depthwise.weight[:2] *= 30
    data = [torch.rand(8, 3, 6, 6) for _ in range(4)]
    x = torch.rand(16, 3, 6, 6)
    measured = {}
    for correct in (False, True):
        config = QuantConfig(weight="per_tensor", bias_correction=correct)
        measured[correct] = sqnr_db(model(x), fxquant.quantize(model, (x,), data, config, progress=False)(x))
    assert measured[True] > measured[False], f"without / with bias correction: {measured} dB"


def test_statistics_merge_like_one_run() -> None:
    conv = nn.Conv2d(3, 4, 3, padding=1)
    one, a, b = InputMeanObserver(conv), InputMeanObserver(conv), InputMeanObserver(conv)
    batches = [torch.randn(2, 3, 5, 5) for _ in range(3)]
    for x in batches:
        one(x)
    a(batches[0])
    b(batches[1])
    b(batches[2])
    a.merge(b)
    torch.testing.assert_close(a.mean(), one.mean())


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))


@pytest.mark.parametrize("layer", [nn.Conv2d(4, 4, 1), nn.Linear(64, 3)], ids=["conv", "linear"])
def test_a_large_batch_is_sampled_every_kth_row_across_the_batch(layer: nn.Module) -> None:
    """Rows (samples, or tokens of a Linear) whose value is their index: the mean of the rows read and their
    number give the stride, which must be prime, spread the sample over the whole batch, and keep it in budget."""
    if isinstance(layer, nn.Conv2d):
        rows, per_row = 300, 4 * 32 * 32
        x = torch.arange(rows, dtype=torch.float32)[:, None, None, None].expand(rows, 4, 32, 32).contiguous()
        positions = 32 * 32
    else:
        rows, per_row = 6000, 64
        x = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 64).reshape(2, rows // 2, 64)
        positions = 1
    assert x.numel() > SAMPLE_VALUES
    observer = InputMeanObserver(layer)
    observer(x)
    used = int(observer.count) // positions
    stride = round(2 * float(observer.mean().flatten()[0]) / (used - 1))  # the mean of 0, k, 2k, ...
    assert _is_prime(stride)
    assert stride * (used - 1) < rows <= stride * used  # every k-th row from the first to the end of the batch
    assert used * per_row <= SAMPLE_VALUES + per_row
    assert int(observer.num_elements) == x.numel()  # the whole batch counts as seen


@pytest.mark.parametrize(("setting", "layers"),
                         [("linear", {"fc"}), (True, {"conv", "depthwise", "fc"}), (False, set())])
def test_which_layers_get_statistics(setting: bool | str, layers: set[str]) -> None:
    """The default observes the Linears only (convolutions' windows made a depthwise net's calibration forward up to
    14% slower)."""
    prepared = fxquant.prepare(ConvNet().eval(), (torch.randn(2, 3, 6, 6),), QuantConfig(bias_correction=setting))
    observed = {m.label.rsplit(" ", 1)[-1] for m in prepared.modules() if isinstance(m, InputMeanObserver)}
    assert observed == layers

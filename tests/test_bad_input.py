"""Bad input gets one clear FxQuantError naming the cause and the fix, and loses nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxquant
from fxquant.errors import CalibrationError, InputError, TraceError
from fxquant.models import create_model
from fxquant.testing import calibrated


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
            return self.fc(x)
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), Gate())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_untraceable_model_names_submodule_line_and_fix() -> None:
    strict = fxquant.QuantConfig(partial_tracing=False)
    with pytest.raises(TraceError) as info:
        fxquant.prepare(Net().eval(), (torch.randn(2, 4),), strict)
    message = str(info.value)
    assert "'body.1'" in message and "Gate" in message
    assert "test_bad_input.py" in message and "if x.sum() > 0" in message
    assert "leaf_modules=['body.1']" in message
    assert "\n" not in message


def test_untraceable_root_forward_names_the_line() -> None:
    with pytest.raises(TraceError, match=r"the model's forward at .*test_bad_input.py:\d+: `if x.sum\(\) > 0:"):
        fxquant.prepare(Gate().eval(), (torch.randn(2, 4),), fxquant.QuantConfig(partial_tracing=False))
    # with partial tracing (the default) the forward runs as written and the layers inside it are quantized
    model = Gate().eval()
    prepared = fxquant.prepare(model, (torch.randn(2, 4),))
    report = fxquant.coverage(prepared)
    assert [(r.path, r.quantized) for r in report.layers] == [("fc", True)], str(report)
    assert "forward of the model itself" in report.graph_breaks[0]
    data = [torch.rand(2, 4) for _ in range(3)]
    fxquant.calibrate(prepared, data, progress=False)
    torch.testing.assert_close(fxquant.convert(prepared)(data[0]), model(data[0]), atol=0.05, rtol=0.05)


def test_leaf_module_from_the_message_makes_it_work() -> None:
    model = Net().eval()
    prepared = fxquant.prepare(model, (torch.randn(2, 4),), fxquant.QuantConfig(leaf_modules=["body.1"]))
    fxquant.calibrate(prepared, [torch.randn(2, 4) for _ in range(2)], progress=False)
    x = torch.randn(3, 4)
    assert fxquant.convert(prepared)(x).shape == model(x).shape


def test_convert_before_calibration_lists_observers() -> None:
    prepared = fxquant.prepare(create_model("conv_bn"), (torch.randn(1, 3, 32, 32),))
    expected = r"3 observer\(s\) saw no data: input_1 \(input of conv\), output of conv, output of fc\. Run "
    with pytest.raises(CalibrationError, match=expected):
        fxquant.convert(prepared)


def test_only_the_observer_that_saw_no_data_is_listed() -> None:
    prepared = calibrated(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).eval(), (2, 4),
                          fxquant.QuantConfig(unobserved="error"))
    prepared.get_submodule("observer_1").num_updates.zero_()  # as if no batch had reached it
    with pytest.raises(CalibrationError, match=r"1 observer\(s\) saw no data: output of 0\. "):
        fxquant.convert(prepared)


@pytest.mark.parametrize(("inputs", "shown"), [
    ((torch.randn(2, 5),), r"Tensor\(2, 5\):torch.float32"),
    ((torch.randn(2, 4).double(),), "torch.float64"),
    ("not a tuple", "must be a tuple"),
])
def test_example_inputs_the_model_rejects(inputs: object, shown: str) -> None:
    with pytest.raises(InputError, match=shown):
        fxquant.prepare(nn.Sequential(nn.Linear(4, 4)).eval(), inputs)


def test_training_mode_model_is_refused_with_the_fix() -> None:
    with pytest.raises(InputError, match=r"training mode; call model.eval\(\)"):
        fxquant.prepare(nn.Sequential(nn.Linear(4, 4)), (torch.randn(1, 4),))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_batch_names_batch_and_leaves_ranges(bad: float) -> None:
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    prepared = calibrated(model, (2, 4))
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    poisoned = torch.randn(2, 4)
    poisoned[1, 2] = bad
    with pytest.raises(CalibrationError, match=r"batch 1 contains NaN or Inf"):
        fxquant.calibrate(prepared, [torch.randn(2, 4), poisoned], progress=False)
    clean_first = {k: v for k, v in prepared.state_dict().items()}
    # batch 0 was clean and counted; nothing of batch 1 reached any observer
    assert all(torch.isfinite(v).all() for k, v in clean_first.items() if k.endswith(("min_val", "max_val")))
    assert int(prepared.observer_0.num_updates) == int(before["observer_0.num_updates"]) + 1


def test_nonfinite_inside_the_model_names_the_observer() -> None:
    class Overflow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.log(x))  # log of a negative input is NaN

    prepared = fxquant.prepare(Overflow().eval(), (torch.rand(2, 4),))
    with pytest.raises(CalibrationError, match=r"batch 0: observer log \(input of fc\) received NaN"):
        fxquant.calibrate(prepared, [-torch.rand(2, 4)], progress=False)


def test_skip_nonfinite_counts_skipped_batches() -> None:
    prepared = fxquant.prepare(nn.Sequential(nn.Linear(4, 4)).eval(), (torch.randn(1, 4),))
    data = [torch.randn(2, 4), torch.full((2, 4), float("nan")), torch.randn(2, 4)]
    summary = fxquant.calibrate(prepared, data, progress=False, skip_nonfinite=True)
    assert summary.batches == 2 and summary.skipped_batches == [1]


def test_empty_data_zero_size_batch_and_wrong_batch_shape() -> None:
    prepared = fxquant.prepare(nn.Sequential(nn.Linear(4, 4)).eval(), (torch.randn(1, 4),))
    with pytest.raises(CalibrationError, match="no usable batch"):
        fxquant.calibrate(prepared, [], progress=False)
    with pytest.raises(InputError, match="batch 1 is empty"):
        fxquant.calibrate(prepared, [torch.randn(2, 4), torch.randn(0, 4)], progress=False)
    with pytest.raises(InputError, match=r"batch 0 \(tensor shapes \[\(2, 7\)\]\) does not fit the model"):
        fxquant.calibrate(prepared, [torch.randn(2, 7)], progress=False)


def test_convert_of_a_foreign_module_is_refused() -> None:
    with pytest.raises(InputError, match=r"not produced by fxquant\.prepare"):
        fxquant.convert(torch.fx.symbolic_trace(nn.Linear(2, 2)))

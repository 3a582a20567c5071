"""Numerical invariants the pipeline relies on, as property tests.

What tests/test_qparams.py and tests/observers already pin (the affine formula on a linspace, exact zero and
minmax coverage for the default range, single-observer order/merge invariance, per-channel with one channel) is
not repeated; this file adds the same guarantees for every observer and every backend's integer range, for weights
per channel, for whole prepared models, at the int8 limits of every backend, and for int32 accumulators.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from spec_model import ModelSpec, SpecModel
from strategies import DataSpec, batches, data_specs, model_specs, observer_batches, profile, quantized_linear
from torch import nn

import fxquant
from fxquant.calibration import observers_of
from fxquant.errors import BackendUnavailableError
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.observers import activation_observer_names, get_activation_observer, get_weight_observer
from fxquant.passes.lower import observer_qparams
from fxquant.qparams import REDUCED_UINT8_RANGE, UINT8_RANGE, QParams, dequantize, fake_quantize, quantize
from fxquant.testing import simulate

ORDER_FREE = ("minmax", "histogram", "percentile", "entropy", "mse")  # moving_average depends on order by design
QRANGES = [UINT8_RANGE, REDUCED_UINT8_RANGE]
RELATIVE = 1e-4  # float32 slack on "half a step" (the clamp of 127.5 to 127 sits exactly on it), in steps


def _observe(name: str, data: list[torch.Tensor]) -> object:
    observer = get_activation_observer(name)()
    for batch in data:
        observer(batch)
    return observer


@pytest.mark.parametrize("name", activation_observer_names())
@pytest.mark.parametrize("qrange", QRANGES, ids=["8bit", "7bit"])
@profile()
@given(data=observer_batches())
def test_inside_the_chosen_range_the_error_is_at_most_half_a_step(name: str, qrange: tuple[int, int],
                                                                  data: list[torch.Tensor]) -> None:
    """For every observer (also the clipping ones, inside the range they chose) and both activation ranges."""
    observer = _observe(name, data)
    qp = observer.qparams(qrange)  # type: ignore[attr-defined]
    lo, hi = (float(v) for v in observer.range())  # type: ignore[attr-defined]
    values = torch.cat([torch.linspace(lo, hi, 257), *(d[(d >= lo) & (d <= hi)] for d in data)])
    step = float(qp.scale)
    worst = float((fake_quantize(values, qp) - values).abs().max())
    assert worst <= step * (0.5 + RELATIVE), f"{name}: error {worst / step:.4f} steps inside [{lo:.4g}, {hi:.4g}]"
    assert float(fake_quantize(torch.zeros(1), qp)) == 0.0, f"{name}: zero is not exact (zp {int(qp.zero_point)})"
    assert qp.qmin <= int(qp.zero_point) <= qp.qmax and step > 0.0 and torch.isfinite(qp.scale)


@pytest.mark.parametrize("scheme", ["per_channel", "per_tensor"])
@profile()
@given(shape=st.sampled_from([(1, 5), (8, 3), (4, 2, 3, 3), (6, 1, 5)]), log_scale=st.floats(-3.0, 3.0),
       seed=st.integers(0, 2**16), zero_rows=st.integers(0, 1))
def test_weights_round_trip_within_half_a_step_with_exact_zero(scheme: str, shape: tuple[int, ...],
                                                               log_scale: float, seed: int, zero_rows: int) -> None:
    """Symmetric int8 weights: zero point 0, every weight within half a step, all-zero rows stay zero."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10.0**log_scale
    weight[:zero_rows] = 0.0
    qp = get_weight_observer(scheme)().qparams(weight)
    assert bool((qp.zero_point == 0).all()) and (qp.qmin, qp.qmax) == (-128, 127)
    step = qp.scale.reshape(-1, *([1] * (weight.dim() - 1))) if qp.axis == 0 else qp.scale
    error = (fake_quantize(weight, qp) - weight).abs() / step
    assert float(error.max()) <= 0.5 + RELATIVE, f"{scheme}: {float(error.max()):.4f} steps"
    assert torch.equal(fake_quantize(weight, qp)[:zero_rows], torch.zeros_like(weight[:zero_rows]))


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("qrange", QRANGES, ids=["8bit", "7bit"])
def test_backend_quantize_saturates_at_the_range_limits(backend: str, qrange: tuple[int, int]) -> None:
    """Values far outside the range land on the first/last grid point (never wrap, never exceed a 7-bit range)."""
    kernel = get_backend(backend)
    qp = QParams(torch.tensor(0.05), torch.tensor(qrange[1] // 3), *qrange)
    x = torch.cat([torch.linspace(-1e6, 1e6, 101), torch.tensor([-3e38, 3e38, 0.0])])
    got = kernel.dequantize(kernel.quantize(x, qp), qp)
    torch.testing.assert_close(got, fake_quantize(x, qp), rtol=0, atol=0)
    edges = dequantize(torch.tensor(qrange), qp)
    assert float(got.min()) == float(edges[0]) and float(got.max()) == float(edges[1]), (got.min(), got.max())


class _Saturating(nn.Module):
    """A depthwise conv (7-bit input on fbgemm), ReLU, an add and a Linear: every kind of int8 output clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.pw = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4 * 5 * 5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.dw(x))
        return self.fc(torch.flatten(y + self.pw(y), 1))


@pytest.mark.parametrize("backend", available_backends())
def test_inputs_far_beyond_the_calibrated_range_saturate_like_the_simulation(backend: str) -> None:
    model = _Saturating().eval()
    prepared = fxquant.prepare(model, (torch.randn(2, 4, 5, 5),))
    fxquant.calibrate(prepared, [torch.randn(8, 4, 5, 5) for _ in range(2)], progress=False)
    qmodel, fake = fxquant.convert(prepared, backend=backend), simulate(prepared, backend)
    step = float(quantized_linear(qmodel, "fc").out_qp.scale)
    for gain in (1.0, 30.0, 1e4):
        x = torch.randn(4, 4, 5, 5) * gain
        error = float((qmodel(x) - fake(x)).abs().max()) / step
        assert error <= 1.0 + RELATIVE, f"{backend}, inputs x{gain}: {error:.2f} steps from the simulation"


def _calibrated_copies(spec: ModelSpec, data: DataSpec, observer: str) -> tuple[torch.fx.GraphModule, ...]:
    """One prepared model, calibrated four ways: on all batches, in reverse order, on each half."""
    parts = batches(spec, data, 4)
    prepared = fxquant.prepare(SpecModel(spec), (parts[0],), fxquant.QuantConfig(activation=observer))
    copies = tuple(copy.deepcopy(prepared) for _ in range(4))
    for model, part in zip(copies, (parts, parts[::-1], parts[:1], parts[1:]), strict=True):
        fxquant.calibrate(model, part, progress=False)
    return copies


def _assert_same_statistics(a: torch.fx.GraphModule, b: torch.fx.GraphModule, what: str) -> None:
    """Identical statistics, except that a histogram may hold some values one bin over: the float32 bin index of a
    signed value within ~1e-4 bins below an edge depends on the grid it was counted on (docs/calibration.md), and
    heavy-tailed data (a coarse grid) can put several values that close to the edge at zero. Each such value moves
    exactly one bin, so the histograms' earth mover's distance equals the number of values moved."""
    for name, observer in observers_of(a).items():
        other = observers_of(b)[name]
        theirs = other.state_dict()
        for key, value in observer.state_dict().items():
            if key == "histogram":
                difference = value - theirs[key]
                moved = float(difference.abs().sum()) / 2
                one_bin = float(torch.cumsum(difference, 0).abs().sum()) == moved
                assert float(value.sum()) == float(theirs[key].sum()) and one_bin and \
                    moved <= 1 + 0.05 * float(value.sum()), f"{what}: {name}.{key}: {moved} counts moved " \
                    f"({observer.label}), {'each by one bin' if one_bin else 'some by more than one bin'}"
            else:
                assert torch.equal(value, theirs[key]), f"{what}: {name}.{key} differs ({observer.label})"
        step = float(observer.qparams().scale)
        gap = max(abs(float(x - y)) for x, y in zip(observer.range(), other.range(), strict=True))
        assert gap <= step, f"{what}: {observer.label}: ranges differ by {gap:.4g} > one step {step:.4g}"


@pytest.mark.parametrize("observer", ORDER_FREE)
@profile(fraction=0.4)
@given(spec=model_specs(max_blocks=4), data=data_specs())
def test_whole_model_statistics_ignore_batch_order_and_splitting(observer: str, spec: ModelSpec,
                                                                 data: DataSpec) -> None:
    """Two prepared copies calibrated on halves and merged hold the statistics of one calibrated on all, and so
    does one calibrated in reverse order (what distributed calibration relies on); with minmax, exactly."""
    everything, reversed_order, first, second = _calibrated_copies(spec, data, observer)
    _assert_same_statistics(everything, reversed_order, "reversed batch order")
    for name, part in observers_of(first).items():
        part.merge(observers_of(second)[name])
    _assert_same_statistics(everything, first, "merged halves")
    if observer == "minmax":
        x = batches(spec, data, 1, offset=9)[0]
        torch.testing.assert_close(fxquant.convert(first, backend="reference")(x),
                                   fxquant.convert(everything, backend="reference")(x), rtol=0, atol=0)


@profile(fraction=0.4)
@given(spec=model_specs(max_blocks=4), data=data_specs(), observer=st.sampled_from(activation_observer_names()))
def test_every_observer_of_a_model_has_valid_qparams_on_every_backend(spec: ModelSpec, data: DataSpec,
                                                                      observer: str) -> None:
    """Finite positive scales, zero points inside the range, exact zero; minmax grids cover what was observed."""
    calibration = batches(spec, data, 3)
    prepared = fxquant.prepare(SpecModel(spec), (calibration[0],), fxquant.QuantConfig(activation=observer))
    fxquant.calibrate(prepared, calibration, progress=False)
    observers = observers_of(prepared)
    for backend in available_backends():
        for name, qp in observer_qparams(prepared, get_backend(backend)).items():
            step, where = float(qp.scale), f"{backend}, {observers[name].label}"
            assert step > 0.0 and torch.isfinite(qp.scale) and qp.qmin <= int(qp.zero_point) <= qp.qmax, where
            assert float(fake_quantize(torch.zeros(1), qp)) == 0.0, where
            if observer == "minmax":
                low, high = (float(v) for v in dequantize(torch.tensor([qp.qmin, qp.qmax]), qp))
                seen_low, seen_high = float(observers[name].min_val), float(observers[name].max_val)
                slack = step * (0.5 + RELATIVE)
                assert low <= seen_low + slack and high >= seen_high - slack, (where, low, high, seen_low, seen_high)


def _extreme_linear(k: int) -> tuple[nn.Module, list[torch.Tensor], torch.Tensor]:
    """Linear(k, 2): weights all +0.01 in row 0 and -0.01 in row 1 (int8 127 and -128 per channel); inputs at
    +-2, calibrated on both signs (zero point 128), evaluated at +2 everywhere: the largest accumulators there are."""
    layer = nn.Linear(k, 2, bias=False)
    with torch.no_grad():
        layer.weight[0], layer.weight[1] = 0.01, -0.01
    positive = torch.full((1, k), 2.0)
    return nn.Sequential(layer).eval(), [positive, -positive], positive


def _int64_reference(qmodel: torch.fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    """What the converted Linear must output, computed with int64 accumulators from its own int8 parameters."""
    layer = quantized_linear(qmodel, "0")
    in_qp, out_qp = layer.in_qp, layer.out_qp
    centered = quantize(x, in_qp).to(torch.int64) - int(in_qp.zero_point)
    acc = centered @ layer.weight.to(torch.int64).t()
    real = acc.double() * float(in_qp.scale) * layer.weight_scale.double()
    return fake_quantize(real.float(), out_qp)


@pytest.mark.parametrize("k", [4096, 65536, 131071, 131072, 262144])
def test_no_int32_accumulator_overflow_on_the_longest_rows(k: int) -> None:
    """Every backend either matches int64 arithmetic or refuses the layer: |acc| reaches 128 * 128 * k, which
    fits int32 up to k = 131071 (the kernels' intermediate sums of q_x * q_w, 255 * 127 * k, already wrap there:
    harmless, as the exact final sum fits) and overflows from 131072 on."""
    model, calibration, x = _extreme_linear(k)
    prepared = fxquant.prepare(model, (x,))
    fxquant.calibrate(prepared, calibration, progress=False)
    for backend in available_backends():
        try:
            qmodel = fxquant.convert(prepared, backend=backend)
        except BackendUnavailableError as refusal:
            assert k > 131071 and "overflow" in str(refusal) and "'0'" in str(refusal), str(refusal)
            continue
        layer = quantized_linear(qmodel, "0")
        steps = float((qmodel(x) - _int64_reference(qmodel, x)).abs().max()) / float(layer.out_qp.scale)
        assert steps <= 1.0, f"{backend} ({layer.backend.name} kernels), k={k}: {steps:.1f} steps from int64"

"""The contract every available backend must pass: same integers in, within one output step of the reference out.

Activation ranges come from each backend's own ``activation_qrange`` (7-bit where fbgemm needs it), so the tests
check the configuration fxquant actually ships, not the kernels' worst case.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from kernel_contract_cases import (
    CONTRACT,
    ConvCase,
    Layer,
    activation,
    backends_under_test,
    conv_cases,
    conv_layer,
    conv_supported,
    float_conv,
    linear_shapes,
    make_layer,
    output_qparams,
    reference_backend,
    run_conv,
    run_linear,
    steps,
)

from fxquant.kernels.base import Backend, ConvSpec
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.qparams import QParams, affine_qparams, dequantize

BACKENDS = backends_under_test()
pytestmark = pytest.mark.usefixtures("onednn_path")  # onednn on its own primitives and on the torch ops


def _backend(name: str) -> Backend:
    return get_backend(name)


CONV_PAIRS = [(n, d) for n in BACKENDS for d in (1, 2, 3) if conv_supported(get_backend(n), d)]
UNSUPPORTED_CONV = [(n, d) for n in BACKENDS for d in (1, 2, 3) if (n, d) not in CONV_PAIRS]


def test_unsupported_conv_is_refused_and_convert_falls_back() -> None:
    """A backend without a kernel says so at prepack; convert then runs that layer on the backend's fallback, which
    must run every conv (with torch 2.13 every backend runs conv1d/2d/3d; onednn's fallback is still used for layers
    whose int32 accumulator could overflow)."""
    for name, dim in UNSUPPORTED_CONV:
        fallback = get_backend(name).fallback
        assert fallback is not None, f"{name} cannot run conv{dim}d and has no fallback backend"
    for name in BACKENDS:
        fallback = get_backend(name).fallback
        if fallback is not None:
            assert all(conv_supported(get_backend(fallback), dim) for dim in (1, 2, 3)), fallback


def _check_conv(backend: Backend, case: ConvCase, seed: int) -> None:
    layer = conv_layer(case, backend.activation_qrange(feeds_grouped_conv=case.spec.groups > 1), seed)
    out_qp = output_qparams(float_conv(layer, case.spec))
    got = run_conv(backend, layer, case.spec, out_qp, relu=case.relu)
    want = run_conv(reference_backend(), layer, case.spec, out_qp, relu=case.relu)
    assert got.shape == want.shape
    lsb = steps(got, want, out_qp)
    assert lsb <= 1, f"{backend.name} conv is {lsb} LSB away from the reference for {case}"


@pytest.mark.parametrize(("name", "dim"), CONV_PAIRS)
def test_conv_matches_reference(name: str, dim: int) -> None:
    backend = _backend(name)

    @CONTRACT
    @given(case=conv_cases(dim), seed=st.integers(0, 2**16))
    def check(case: ConvCase, seed: int) -> None:
        _check_conv(backend, case, seed)

    check()


@pytest.mark.parametrize("name", BACKENDS)
@CONTRACT
@given(shape=linear_shapes(), per_channel=st.booleans(), bias=st.booleans(), relu=st.booleans(),
       seed=st.integers(0, 2**16))
def test_linear_matches_reference(name: str, shape: tuple[tuple[int, ...], int, int], per_channel: bool,
                                  bias: bool, relu: bool, seed: int) -> None:
    backend = _backend(name)
    lead, k, n = shape
    layer = make_layer((*lead, k), (n, k), qrange=backend.activation_qrange(feeds_grouped_conv=False),
                       per_channel=per_channel, bias=bias, seed=seed)
    out_qp = output_qparams(F.linear(layer.x.double(), layer.w.double(), _double(layer.bias)))
    got = run_linear(backend, layer, out_qp, relu=relu)
    want = run_linear(reference_backend(), layer, out_qp, relu=relu)
    assert got.shape == want.shape == (*lead, n)
    assert steps(got, want, out_qp) <= 1, f"{name} linear is {steps(got, want, out_qp)} LSB off for {shape}"


def _double(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def _two_activations(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, QParams, torch.Tensor, QParams]:
    gen = torch.Generator().manual_seed(seed)
    q_a, qa = activation(shape, (0, 255), gen)
    q_b, qb = activation(shape, (0, 255), gen)
    return q_a, qa, q_b, _with_scale(qb, float(qa.scale) * 3.7)  # scales that differ a lot


def _with_scale(qp: QParams, scale: float) -> QParams:
    return QParams(torch.tensor(scale), qp.zero_point, qp.qmin, qp.qmax, qp.axis)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("relu", [False, True])
def test_add_with_different_scales_matches_reference(name: str, relu: bool) -> None:
    backend, ref = _backend(name), reference_backend()
    for seed in range(5):
        q_a, qa, q_b, qb = _two_activations((2, 5, 7, 3), seed)
        a, b = dequantize(q_a, qa), dequantize(q_b, qb)
        total = a + b
        qout = affine_qparams(total.min(), total.max())
        got = backend.dequantize(backend.add(backend.quantize(a, qa), backend.quantize(b, qb), qa, qb, qout,
                                             relu=relu), qout)
        want = ref.dequantize(ref.add(ref.quantize(a, qa), ref.quantize(b, qb), qa, qb, qout, relu=relu), qout)
        assert steps(got, want, qout) <= 1, f"{name} add is {steps(got, want, qout)} LSB off (seed {seed})"


@pytest.mark.parametrize("name", BACKENDS)
def test_relu_matches_reference_exactly(name: str) -> None:
    backend, ref = _backend(name), reference_backend()
    q, qp = activation((3, 4, 5), (0, 255), torch.Generator().manual_seed(1))
    x = dequantize(q, qp)
    got = backend.dequantize(backend.relu(backend.quantize(x, qp), qp), qp)
    want = ref.dequantize(ref.relu(ref.quantize(x, qp), qp), qp)
    assert steps(got, want, qp) == 0
    assert bool((want >= 0).all())


POOLS: list[tuple[int, dict[str, Any]]] = [
    (1, {"kernel_size": 3}),
    (2, {"kernel_size": 2}),
    (2, {"kernel_size": 3, "stride": 2, "padding": 1}),
    (2, {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False, "ceil_mode": True}),
    (3, {"kernel_size": 2, "stride": 1}),
]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("dim", "kwargs"), POOLS)
def test_avg_pool_matches_reference(name: str, dim: int, kwargs: dict[str, Any]) -> None:
    backend, ref = _backend(name), reference_backend()
    q, qp = activation((2, 3, *([7] * dim)), (0, 255), torch.Generator().manual_seed(dim))
    x = dequantize(q, qp)
    got = backend.dequantize(backend.avg_pool(backend.quantize(x, qp), qp, dim, kwargs), qp)
    want = ref.dequantize(ref.avg_pool(ref.quantize(x, qp), qp, dim, kwargs), qp)
    assert got.shape == want.shape
    assert steps(got, want, qp) <= 1, f"{name} avg_pool{dim}d {kwargs} is {steps(got, want, qp)} LSB off"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("dim", "output_size"), [(1, 3), (2, 1), (2, (3, 2)), (3, 2)])
def test_adaptive_avg_pool_matches_reference(name: str, dim: int, output_size: Any) -> None:
    backend, ref = _backend(name), reference_backend()
    q, qp = activation((2, 3, *([7] * dim)), (0, 255), torch.Generator().manual_seed(10 + dim))
    x = dequantize(q, qp)
    got = backend.dequantize(backend.adaptive_avg_pool(backend.quantize(x, qp), qp, output_size), qp)
    want = ref.dequantize(ref.adaptive_avg_pool(ref.quantize(x, qp), qp, output_size), qp)
    assert steps(got, want, qp) <= 1


def _after_conv(b: Backend, layer: Layer, spec: ConvSpec, out_qp: QParams) -> list[torch.Tensor]:
    """A conv output fed to relu, to add (next to a contiguous tensor) and to max-pool, each dequantized."""
    packed = b.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    y = b.conv(b.quantize(layer.x, layer.in_qp), packed, layer.in_qp, out_qp, relu=False)
    other = b.quantize(torch.linspace(-1, 1, y.numel()).reshape(y.shape), out_qp)
    pool = {"kernel_size": 3, "stride": 2, "padding": 1}
    outputs = [b.relu(y, out_qp), b.add(y, other, out_qp, out_qp, out_qp, relu=False),
               b.max_pool(y, out_qp, spec.dim, pool)]
    return [b.dequantize(out, out_qp) for out in outputs]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dim", [1, 2])
def test_conv_output_feeds_relu_add_and_max_pool(name: str, dim: int) -> None:
    """Conv outputs may be channels-last (oneDNN, qnnpack); the ops after them must read them right. More than 127
    positions per channel, where torch's channels-last int8 max-pool fails."""
    backend = _backend(name)
    spec = ConvSpec(dim, (1,) * dim, (1,) * dim, (1,) * dim, 1)
    size = (150,) if dim == 1 else (12, 13)
    case = ConvCase(spec, 2, 3, 6, (3,) * dim, size, per_channel=True, bias=True, relu=False)
    layer = conv_layer(case, backend.activation_qrange(feeds_grouped_conv=False), seed=3)
    out_qp = output_qparams(float_conv(layer, spec))
    got = _after_conv(backend, layer, spec, out_qp)
    want = _after_conv(reference_backend(), layer, spec, out_qp)
    for op, g, w in zip(("relu", "add", "max_pool"), got, want, strict=True):
        assert steps(g, w, out_qp) <= 1, f"{name}: {op} after conv{dim}d is {steps(g, w, out_qp)} LSB off"


_NO_WARNING_SCRIPT = """
import sys, warnings
sys.path.insert(0, sys.argv[1])
from kernel_contract_cases import run_conv_add_linear
from fxquant.kernels.registry import get_backend
backend = get_backend(sys.argv[2])
warnings.simplefilter("error")  # after the imports: only what the backend itself does counts
run_conv_add_linear(backend)
"""


@pytest.mark.parametrize("name", [n for n in ("onednn", "reference") if n in available_backends()])
def test_a_conv_add_linear_run_emits_no_warning(name: str) -> None:
    """Neither plain-int8 backend touches deprecated torch APIs. torch warns about quantized dtypes once per
    process, so this runs in a fresh one where any warning is an error."""
    here = str(Path(__file__).parent)
    child = subprocess.run([sys.executable, "-c", _NO_WARNING_SCRIPT, here, name], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]

"""Contract tests for the fused kernels (conv + add, Linear with a float output) and the plain-uint8 fast paths
(max-pool through ``quantized::max_pool2d``, quantize into channels-last): every backend against the reference.

A backend with the fused kernel (``fuses_conv_add`` / ``fuses_float_output``) must match the reference's single
rounding within one output step; one without it runs the separate ops, and must match the reference's separate ops.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_contract_cases import (
    CONTRACT,
    ConvCase,
    activation,
    backends_under_test,
    conv_cases,
    conv_layer,
    float_conv,
    loop_threads,
    make_layer,
    output_qparams,
    reference_backend,
    require_c_loops,
    steps,
)

from fxquant.kernels.base import UNARY_FUNCTIONS, Backend, ConvAddQParams, ConvSpec
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.qparams import QParams, affine_qparams, dequantize, quantize

BACKENDS = backends_under_test()
pytestmark = pytest.mark.usefixtures("onednn_path")  # onednn on its own primitives and on the torch ops
PLAIN = [n for n in ("onednn", "reference") if n in available_backends()]


def _conv_add(backend: Backend, case: ConvCase, seed: int, fused: bool, *, channels_last: bool = False,
              qrange: tuple[int, int] = (0, 255)) -> tuple[Any, ...]:
    """``conv(x) + accum`` on ``backend``, as its ``conv_add`` or as its separate conv and add; dequantized."""
    layer = conv_layer(case, qrange, seed)
    y = float_conv(layer, case.spec)
    q_acc, acc_qp = activation(tuple(y.shape), (0, 255), torch.Generator().manual_seed(seed + 1))
    total = y + dequantize(q_acc, acc_qp)
    qps = ConvAddQParams(layer.in_qp, output_qparams(y), acc_qp, affine_qparams(total.min(), total.max()))
    packed = backend.prepack_conv(layer.q_w, layer.w_qp, layer.bias, case.spec, in_qp=layer.in_qp)
    accum = backend.quantize(dequantize(q_acc, acc_qp), acc_qp)
    if channels_last and accum.dim() == 4 and not accum.is_quantized:
        accum = accum.contiguous(memory_format=torch.channels_last)
    a = backend.quantize(layer.x, layer.in_qp)
    if fused:
        out = backend.conv_add(a, packed, accum, qps, relu=case.relu)
    else:
        conv = backend.conv(a, packed, qps.input, qps.conv, relu=False)
        out = backend.add(conv, accum, qps.conv, qps.accum, qps.out, relu=case.relu)
    return backend.dequantize(out, qps.out), qps.out


@pytest.mark.parametrize("name", BACKENDS)
def test_conv_add_matches_the_reference(name: str) -> None:
    backend = get_backend(name)

    @CONTRACT
    @given(case=conv_cases(2), seed=st.integers(0, 2**16), channels_last=st.booleans())
    def check(case: ConvCase, seed: int, channels_last: bool) -> None:
        qrange = backend.activation_qrange(feeds_grouped_conv=case.spec.groups > 1)
        got, out_qp = _conv_add(backend, case, seed, True, channels_last=channels_last, qrange=qrange)
        want, _ = _conv_add(reference_backend(), case, seed, backend.fuses_conv_add, channels_last=channels_last,
                            qrange=qrange)
        assert got.shape == want.shape
        lsb = steps(got, want, out_qp)
        assert lsb <= 1, f"{name} conv_add is {lsb} LSB away from the reference for {case}"

    check()


def test_reference_conv_add_rounds_once() -> None:
    """The fused reference is the exact sum rounded once: within half a step of the float computation."""
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    case = ConvCase(spec, 2, 5, 6, (3, 3), (7, 6), True, True, False)
    got, out_qp = _conv_add(reference_backend(), case, 3, True)
    layer = conv_layer(case, (0, 255), 3)
    y = float_conv(layer, spec)
    q_acc, acc_qp = activation(tuple(y.shape), (0, 255), torch.Generator().manual_seed(4))
    exact = y + dequantize(q_acc, acc_qp).double()
    error = float((got.double() - exact).abs().max()) / float(out_qp.scale)
    assert error <= 0.5 + 1e-6, f"fused reference is {error:.3f} steps from the exact sum"


@pytest.mark.parametrize("name", BACKENDS)
@CONTRACT
@given(lead=st.sampled_from(((1,), (3, 17), (2, 5, 4))), k=st.sampled_from((2, 7, 64)), n=st.integers(1, 40),
       relu=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_to_float_matches_the_reference(name: str, lead: tuple[int, ...], k: int, n: int, relu: bool,
                                               seed: int) -> None:
    backend, ref = get_backend(name), reference_backend()
    layer = make_layer((*lead, k), (n, k), qrange=backend.activation_qrange(feeds_grouped_conv=False),
                       per_channel=bool(seed % 2), bias=True, seed=seed)
    y = torch.nn.functional.linear(layer.x.double(), layer.w.double(), layer.bias.double())  # type: ignore[union-attr]
    out_qp = output_qparams(y)

    def run(b: Backend) -> torch.Tensor:
        packed = b.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
        return b.linear_to_float(b.quantize(layer.x, layer.in_qp), packed, layer.in_qp, out_qp, relu=relu)

    got = run(backend)
    assert got.dtype == torch.float32 and got.shape == (*lead, n)
    if backend.fuses_float_output:  # unrounded: far closer than the half step a rounding would add
        error = float((got.double() - run(ref).double()).abs().max()) / float(out_qp.scale)
        # plus half an accumulator step: oneDNN adds the float bias, the reference rounds it to int32 first
        bias_rounding = 0.5 * float(layer.in_qp.scale) * float(layer.w_qp.scale.max()) / float(out_qp.scale)
        assert error <= 0.05 + bias_rounding, f"{name} float linear is {error:.3f} steps from the reference"
    else:
        want = ref.dequantize(ref.linear(ref.quantize(layer.x, layer.in_qp), ref.prepack_linear(
            layer.q_w, layer.w_qp, layer.bias), layer.in_qp, out_qp, relu=relu), out_qp)
        assert steps(got, want, out_qp) <= 1


UNARY_CASES = [("linear", name) for name in ("silu", "hardswish", "gelu", "gelu_tanh")] + \
    [("conv", name) for name in ("silu", "hardswish")]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("layer_kind", "unary"), UNARY_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_unary_post_ops_match_the_reference(name: str, layer_kind: str, unary: str, seed: int) -> None:
    """``f(layer(x))`` quantized once: within one step of the reference's float result, function and rounding,
    fused (oneDNN's post-op) or not (the default sequence), conv1d and conv3d (no such post-ops) included."""
    backend, ref = get_backend(name), reference_backend()
    qrange = backend.activation_qrange(feeds_grouped_conv=False)
    dims = seed % 3 + 1 if layer_kind == "conv" else 0  # conv1d, conv2d, conv3d
    if layer_kind == "conv":
        spec = ConvSpec(dims, (1,) * dims, (1,) * dims, (1,) * dims, 1)
        case = ConvCase(spec, 2, 5, 7, (3,) * dims, (6,) * dims, bool(seed % 2), True, False)
        layer = conv_layer(case, qrange, seed)
        y = float_conv(layer, spec)
    else:
        layer = make_layer((3, 4, 24), (9, 24), qrange=qrange, per_channel=bool(seed % 2), bias=True, seed=seed)
        y = torch.nn.functional.linear(layer.x.double(), layer.w.double(), layer.bias.double())  # type: ignore[union-attr]
    out_qp, unary_qp = output_qparams(y), output_qparams(UNARY_FUNCTIONS[unary](y))

    def run(b: Backend) -> torch.Tensor:
        a = b.quantize(layer.x, layer.in_qp)
        if layer_kind == "conv":
            packed = b.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
            return b.dequantize(b.conv_unary(a, packed, layer.in_qp, out_qp, unary, unary_qp), unary_qp)
        packed = b.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
        return b.dequantize(b.linear_unary(a, packed, layer.in_qp, out_qp, unary, unary_qp), unary_qp)

    got = run(backend)
    assert got.shape == y.shape
    if backend.fuses_float_output:
        assert steps(got, run(ref), unary_qp) <= 1
    else:  # fbgemm/qnnpack round the layer's own output first, as before any fusion: one more rounding
        assert steps(got, run(ref), unary_qp) <= 2


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize(("shape_a", "shape_b"), [((2, 6, 5, 5), (2, 6, 1, 1)), ((2, 6, 1, 1), (2, 6, 5, 5)),
                                                  ((3, 7), (3, 7)), ((4, 1, 5), (1, 3, 1))])
def test_mul_rounds_the_exact_product_once(name: str, shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> None:
    """``(qa - za)(qb - zb) sa sb`` rounded once to the output grid, broadcasting either way (an SE gate)."""
    gen = torch.Generator().manual_seed(len(shape_a))
    (qa, pa), (qb, pb) = activation(shape_a, (0, 255), gen), activation(shape_b, (0, 255), gen)
    exact = dequantize(qa, pa).double() * dequantize(qb, pb).double()
    qout = affine_qparams(exact.min().float(), exact.max().float())
    got = get_backend(name).mul(qa, qb, pa, pb, qout)
    want = torch.clamp(torch.round(exact / float(qout.scale)) + int(qout.zero_point), 0, 255)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert int((got.double() - want).abs().max()) <= 1
    assert float((got.double() != want).double().mean()) < 0.01  # only float32 ties (onednn) may differ


POOLS: list[tuple[int, dict[str, Any]]] = [
    (1, {"kernel_size": 3}),
    (1, {"kernel_size": 2, "stride": 1, "padding": 1, "dilation": 2, "ceil_mode": True}),
    (2, {"kernel_size": 3, "stride": 2, "padding": 1}),
    (2, {"kernel_size": (2, 3), "stride": (1, 2), "padding": (1, 0), "dilation": (2, 1), "ceil_mode": True}),
    (2, {"kernel_size": 2, "stride": None}),
    (2, {"kernel_size": (3, 2)}),
    (3, {"kernel_size": 2}),
    (3, {"kernel_size": (1, 2, 3), "stride": (1, 2, 3)}),
    (3, {"kernel_size": 3, "stride": 2, "padding": 1}),
]


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize(("dim", "kwargs"), POOLS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "unbatched"])
def test_max_pool_is_exact(name: str, dim: int, kwargs: dict[str, Any], layout: str) -> None:
    """Max-pool is order-preserving, so every backend must give aten's max-pool of the integers exactly, more than
    127 positions per channel included (where aten's channels-last uint8 kernel refuses)."""
    size = 7 if dim == 3 else 13
    q = torch.randint(0, 256, (2, 5, *([size] * dim)), dtype=torch.uint8, generator=torch.Generator().manual_seed(dim))
    if layout == "channels_last" and dim > 1:
        q = q.contiguous(memory_format=torch.channels_last if dim == 2 else torch.channels_last_3d)
    if layout == "unbatched":
        q = q[0]
    qp = QParams(torch.tensor(0.1), torch.tensor(3), 0, 255)
    functional = {1: torch.nn.functional.max_pool1d, 2: torch.nn.functional.max_pool2d,
                  3: torch.nn.functional.max_pool3d}[dim]
    want = functional(q.float().contiguous(), **kwargs).to(torch.uint8)
    got = get_backend(name).max_pool(q, qp, dim, kwargs)
    assert got.dtype == torch.uint8 and torch.equal(got, want)


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.usefixtures("native_loops")
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=5), seed=st.integers(0, 2**16),
       signed=st.booleans(), layout=st.sampled_from(["contiguous", "channels_last", "strided"]))
@CONTRACT
def test_quantize_equals_the_qparams_formula(name: str, shape: list[int], seed: int, signed: bool,
                                             layout: str) -> None:
    """Quantize (the C loop, or in torch without it) is ``qparams.quantize`` exactly, whatever the input's memory
    layout, rounding ties included; 4-d inputs come out channels-last on backends that compute in that layout."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 5
    qp = QParams(torch.tensor(0.01 + float(torch.rand((), generator=gen))),
                 torch.tensor(-3 if signed else 121), *((-128, 127) if signed else (0, 255)))
    if x.numel() >= 6:  # exact ties (half-to-even decides) and values far outside the range
        x.view(-1)[:6] = torch.tensor([0.5, 1.5, -2.5, 1e30, -1e30, 2.5]) * qp.scale
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided" and x.dim() >= 2:
        x = x.transpose(0, -1)
    backend = get_backend(name)
    got = backend.quantize(x, qp)
    assert torch.equal(got, quantize(x, qp))
    if x.dim() == 4 and x.numel() and getattr(backend, "channels_last", False):
        assert got.is_contiguous(memory_format=torch.channels_last)


_NO_WARNING_SCRIPT = """
import sys, warnings
import torch
from fxquant.kernels.registry import get_backend
from fxquant.qparams import QParams
backend = get_backend(sys.argv[1])
qp = QParams(torch.tensor(0.1), torch.tensor(3), 0, 255)
warnings.simplefilter("error")
q = backend.quantize(torch.randn(2, 4, 20, 20), qp)
backend.dequantize(backend.max_pool(q, qp, 2, {"kernel_size": 3, "stride": 2, "padding": 1}), qp)
"""


@pytest.mark.parametrize("name", PLAIN)
def test_max_pool_and_quantize_emit_no_warning(name: str) -> None:
    """``quantized::max_pool2d`` on plain uint8 touches no deprecated dtype: a fresh process sees no warning."""
    child = subprocess.run([sys.executable, "-c", _NO_WARNING_SCRIPT, name], capture_output=True, text=True,
                           timeout=120, cwd=str(Path(__file__).parent))
    assert child.returncode == 0, child.stderr[-3000:]


@pytest.mark.parametrize("name", PLAIN)
def test_quantize_takes_an_input_that_requires_grad(name: str) -> None:
    """A converted model called outside ``no_grad`` (a float BatchNorm before the first layer makes its input
    require grad): quantize rounds a detached copy, as ``qparams.quantize`` would."""
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    qp = QParams(torch.tensor(0.05), torch.tensor(100), 0, 255)
    assert torch.equal(get_backend(name).quantize(x, qp), quantize(x.detach(), qp))


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize(("shape", "dtype"), [((3, 70_000), torch.float32), ((5, 3, 150, 150), torch.float32),
                                              ((4, 40_000), torch.float16), ((2, 33_000), torch.float64)])
def test_chunked_quantize_equals_the_formula(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Above the small-tensor cutoff quantize runs in chunks of whole samples on reused buffers: still the formula
    exactly, for every sample, whatever the float type; 4-d results channels-last on backends computing so."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 4).to(dtype)
    qp = QParams(torch.tensor(0.03), torch.tensor(121), 0, 255)
    backend = get_backend(name)
    got = backend.quantize(x, qp)
    assert torch.equal(got, quantize(x, qp))
    if len(shape) == 4 and getattr(backend, "channels_last", False):
        assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(("shape", "channels_last", "dtype"), [((2, 3, 9, 7), True, torch.uint8),
                                                               ((2, 3, 9, 7), False, torch.int8),
                                                               # NHWC interleave: 2, 3, 4 channels, then groups of
                                                               # four and a remainder; 323 positions: a block's tail
                                                               ((2, 3, 17, 19), True, torch.int8),
                                                               ((1, 2, 17, 19), True, torch.uint8),
                                                               ((1, 4, 17, 19), True, torch.int8),
                                                               ((2, 5, 17, 19), True, torch.uint8),
                                                               ((1, 8, 33, 9), True, torch.int8),
                                                               ((5, 300), False, torch.uint8),
                                                               ((1, 64, 1, 1), True, torch.uint8)])
def test_the_c_quantize_takes_float32_inputs(shape: tuple[int, ...], channels_last: bool, dtype: torch.dtype) -> None:
    """The C loop runs (it is not silently skipped) and equals the formula, NCHW -> NHWC included."""
    from fxquant.kernels.plain_int8 import _native_quantize

    require_c_loops()
    x = torch.randn(shape) * 3
    qp = QParams(torch.tensor(0.02), torch.tensor(0 if dtype == torch.int8 else 100),
                 *((-128, 127) if dtype == torch.int8 else (0, 255)))
    with loop_threads("elementwise"):
        got = _native_quantize(x, qp, channels_last)
    assert got is not None and got.dtype == dtype and torch.equal(got, quantize(x, qp))
    if channels_last:
        assert got.is_contiguous(memory_format=torch.channels_last)

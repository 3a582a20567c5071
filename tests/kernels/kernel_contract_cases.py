"""Shared builders for the kernel contract tests: random int8 layers, their qparams, and an LSB distance.

Every case is built from integers first (activations, weights) and turned into floats by dequantizing them, so every
backend receives exactly the same integers whatever its activation representation.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from fxquant import native
from fxquant.errors import BackendUnavailableError
from fxquant.kernels.base import Backend, ConvSpec, PackedWeight
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.native.isa import ISA_LEVELS, has_avx512, has_vnni, isa_cap
from fxquant.qparams import INT8_RANGE, QParams, affine_qparams, dequantize, fake_quantize

FLOAT_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class ConvCase:
    """One convolution to run: geometry plus the knobs hypothesis varies."""

    spec: ConvSpec
    batch: int
    in_channels: int
    out_channels: int
    kernel: tuple[int, ...]
    size: tuple[int, ...]
    per_channel: bool
    bias: bool
    relu: bool

    @property
    def flags(self) -> tuple[bool, bool, bool]:
        return self.per_channel, self.bias, self.relu


@dataclass(frozen=True)
class Layer:
    """Integer inputs of one layer and the qparams they are read with; ``x``/``w`` are their float values."""

    q_x: torch.Tensor
    in_qp: QParams
    q_w: torch.Tensor
    w_qp: QParams
    bias: torch.Tensor | None

    @property
    def x(self) -> torch.Tensor:
        return dequantize(self.q_x, self.in_qp)

    @property
    def w(self) -> torch.Tensor:
        return dequantize(self.q_w, self.w_qp)


def require_c_loops() -> None:
    """Skip where ``FXQUANT_NATIVE=0`` turns the C loops off on purpose; fail where they were not built."""
    if os.environ.get(native.DISABLE_ENV) == "0":
        pytest.skip(f"{native.DISABLE_ENV}=0 turns the C loops off")
    assert native.loops is not None, "fxquant.native._native was not built: reinstall with a C compiler"


def require_loop(what: str, flag: str, level: str) -> None:
    """Skip, with the reason, where ``what`` cannot run: the C loops off on purpose, a CPU without ``flag``, or
    ``FXQUANT_ISA`` capped below ``level``; fail where the loops were not built."""
    require_c_loops()
    if flag not in cpu_flags():
        pytest.skip(f"{what} needs {flag}, which this CPU lacks")
    if isa_cap() < ISA_LEVELS.index(level):
        pytest.skip(f"FXQUANT_ISA caps the loops below {level}")


def require_avx2_alone(what: str) -> None:
    """Skip, with the reason, where ``what`` (an AVX2 loop the onednn backend takes on CPUs with AVX2 alone) does not
    run: the C loops off, a CPU without AVX2, or AVX512/VNNI allowed (``FXQUANT_ISA=avx2`` runs it there, as
    ``.ci/run`` does)."""
    require_c_loops()
    if "avx2" not in cpu_flags():
        pytest.skip(f"{what} needs AVX2, which this CPU lacks")
    if has_avx512() or has_vnni():
        pytest.skip(f"the onednn backend's {what} runs where AVX2 is the highest instruction set fxquant may use "
                    "(with VNNI its activations are 8-bit and oneDNN's VNNI kernels are faster); FXQUANT_ISA=avx2 "
                    "runs it on this CPU")


def count_calls(monkeypatch: pytest.MonkeyPatch, entry: str) -> list[int]:
    """Every call of the C extension's ``entry`` from now on (by calls bound after this: the loops' wrappers take
    their entry point when they are made)."""
    calls: list[int] = []
    original = getattr(native.loader.extension, entry)

    def counted(*args: Any) -> Any:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(native.loader.extension, entry, counted)
    return calls


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (what ``__builtin_cpu_supports`` in the C loops also reads)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "flags:")
    return frozenset(line.split(":", 1)[1].split())


# For the tests of fxquant's C loops that give the bytes of its own oneDNN primitives (rows, Winograd, depthwise):
# without the primitives there is nothing to compare with.
ONEDNN_PRIMITIVES = pytest.mark.skipif(platform.machine() != "x86_64" or not onednn_direct.available(),
                                       reason=f"fxquant's oneDNN primitives do not run here: {onednn_direct.status()}")


def at_thread_counts(family: str, run: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """``run()`` at one thread and at ``family``'s limit (``native.THREAD_LIMITS``): a loop's results at both."""
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, native.THREAD_LIMITS[family]):
            torch.set_num_threads(threads)
            outs.append(run())
        return outs
    finally:
        torch.set_num_threads(previous)


@contextmanager
def declined(monkeypatch: pytest.MonkeyPatch, module: Any, builder: str) -> Iterator[None]:
    """Calls bound inside go to oneDNN's primitive: ``module.builder`` (a C loop's call builder, which returns None
    for a layer the loop does not take) declines every layer."""
    with monkeypatch.context() as patch:
        patch.setattr(module, builder, lambda *args, **kwargs: None)
        yield


@contextmanager
def loop_threads(family: str) -> Iterator[None]:
    """torch's thread count capped at ``family``'s limit (``native.THREAD_LIMITS``): where its C loops may run."""
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, native.THREAD_LIMITS[family]))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def activation_range(backend: Backend | str, *, grouped: bool = False) -> tuple[int, int]:
    """The activation range ``backend`` declares on this CPU, as convert uses it: 7 bits where its kernels sum u8*s8
    pairs in 16 bits (fbgemm's grouped convs; fbgemm and oneDNN without VNNI), else 8."""
    kernel = get_backend(backend) if isinstance(backend, str) else backend
    return kernel.activation_qrange(feeds_grouped_conv=grouped)


def zero_point_in(qrange: tuple[int, int], eight_bit: int) -> int:
    """The zero point at the place of ``eight_bit`` (one of 0..255) within ``qrange``: itself on an 8-bit range."""
    qmin, qmax = qrange
    return qmin + round(eight_bit * (qmax - qmin) / 255)


def activation(shape: tuple[int, ...], qrange: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, QParams]:
    """Random integers over the whole of ``qrange`` with a zero point inside it, as uint8."""
    qmin, qmax = qrange
    zero_point = int(torch.randint(qmin, qmax + 1, (), generator=gen))
    scale = torch.tensor(0.01 + 0.05 * float(torch.rand((), generator=gen)))
    q = torch.randint(qmin, qmax + 1, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
    return q, QParams(scale, torch.tensor(zero_point), qmin, qmax)


def weight(shape: tuple[int, ...], per_channel: bool, gen: torch.Generator) -> tuple[torch.Tensor, QParams]:
    """Random symmetric int8 weights (full [-128, 127]) with per-tensor or per-output-channel scales."""
    q = torch.randint(INT8_RANGE[0], INT8_RANGE[1] + 1, shape, generator=gen, dtype=torch.int64).to(torch.int8)
    n = shape[0] if per_channel else 1
    scale = 0.002 + 0.01 * torch.rand(n, generator=gen)
    scale = scale if per_channel else scale[0]
    return q, QParams(scale, torch.zeros(scale.shape, dtype=torch.int64), *INT8_RANGE, 0 if per_channel else None)


def make_layer(x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, qrange: tuple[int, int], per_channel: bool,
               bias: bool, seed: int) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    q_x, in_qp = activation(x_shape, qrange, gen)
    q_w, w_qp = weight(w_shape, per_channel, gen)
    b = torch.randn(w_shape[0], generator=gen) if bias else None
    return Layer(q_x, in_qp, q_w, w_qp, b)


def conv_layer(case: ConvCase, qrange: tuple[int, int], seed: int) -> Layer:
    x_shape = (case.batch, case.in_channels, *case.size)
    w_shape = (case.out_channels, case.in_channels // case.spec.groups, *case.kernel)
    return make_layer(x_shape, w_shape, qrange=qrange, per_channel=case.per_channel, bias=case.bias, seed=seed)


def float_conv(layer: Layer, spec: ConvSpec) -> torch.Tensor:
    """The convolution of the dequantized input with the dequantized weights, in float64."""
    b = None if layer.bias is None else layer.bias.double()
    return FLOAT_CONVS[spec.dim](layer.x.double(), layer.w.double(), b, spec.stride, spec.padding, spec.dilation,
                                 spec.groups)


def output_qparams(y: torch.Tensor) -> QParams:
    """uint8 qparams spanning ``y`` (what a calibrated observer would pick)."""
    return affine_qparams(y.min().float(), y.max().float())


def fake_quantized(y: torch.Tensor, qp: QParams, *, relu: bool) -> torch.Tensor:
    return fake_quantize(torch.relu(y) if relu else y, qp)


def steps(a: torch.Tensor, b: torch.Tensor, qp: QParams) -> int:
    """Largest distance between two dequantized tensors on ``qp``'s grid, in output steps (LSB)."""
    if a.numel() == 0:
        return 0
    scale = float(qp.scale)
    return int((torch.round(a.double() / scale) - torch.round(b.double() / scale)).abs().max())


def run_conv_quantized(backend: Backend, layer: Layer, spec: ConvSpec, out_qp: QParams, *,
                       relu: bool) -> torch.Tensor:
    """Prepack and convolve on ``backend``; the output stays in the backend's activation representation."""
    packed = backend.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    return backend.conv(backend.quantize(layer.x, layer.in_qp), packed, layer.in_qp, out_qp, relu=relu)


def run_conv(backend: Backend, layer: Layer, spec: ConvSpec, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    """Prepack, convolve and dequantize on ``backend``."""
    return backend.dequantize(run_conv_quantized(backend, layer, spec, out_qp, relu=relu), out_qp)


def run_linear(backend: Backend, layer: Layer, out_qp: QParams, *, relu: bool) -> torch.Tensor:
    packed: PackedWeight = backend.prepack_linear(layer.q_w, layer.w_qp, layer.bias)
    out = backend.linear(backend.quantize(layer.x, layer.in_qp), packed, layer.in_qp, out_qp, relu=relu)
    return backend.dequantize(out, out_qp)


def reference_backend() -> Backend:
    return get_backend("reference")


def backends_under_test() -> list[str]:
    """Every backend this machine can run, except the reference they are compared with."""
    return [name for name in available_backends() if name != "reference"]


def conv_supported(backend: Backend, dim: int) -> bool:
    """Whether ``backend`` runs convNd at all (it raises BackendUnavailableError at prepack if not)."""
    spec = ConvSpec(dim, (1,) * dim, (0,) * dim, (1,) * dim, 1)
    q_w, w_qp = weight((1, 1, *([1] * dim)), False, torch.Generator().manual_seed(0))
    in_qp = QParams(torch.tensor(0.1), torch.tensor(0), 0, 255)
    try:
        backend.prepack_conv(q_w, w_qp, None, spec, in_qp=in_qp)
    except BackendUnavailableError:
        return False
    return True


@st.composite
def conv_cases(draw: st.DrawFn, dim: int) -> ConvCase:
    """Small convolutions with odd channel counts, groups, depthwise (with channel multipliers), stride, padding
    and dilation, including inputs where some outputs read padding only or are one column wide."""
    groups = draw(st.sampled_from((1, 1, 2, 3, 5, 8)))
    in_per_group = draw(st.sampled_from((1, 1, 2, 3))) if groups > 1 else draw(st.integers(1, 7))
    out_per_group = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dim))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(dim))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(dim))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dim))
    largest = 8 if dim < 3 else 5
    size = tuple(
        draw(st.integers(max(1, d * (k - 1) + 1 - 2 * p), largest))
        for k, p, d in zip(kernel, padding, dilation, strict=True)
    )
    spec = ConvSpec(dim, stride, padding, dilation, groups)
    flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return ConvCase(spec, draw(st.integers(1, 2)), groups * in_per_group, groups * out_per_group, kernel, size,
                    *flags)


@st.composite
def linear_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, in_features, out_features), covering batch 1, batches above 16 and K == 1."""
    lead = tuple(draw(st.lists(st.sampled_from((1, 2, 3, 17, 40)), min_size=1, max_size=3)))
    return lead, draw(st.sampled_from((1, 2, 7, 8, 33, 64))), draw(st.integers(1, 40))


# derandomized: every run (CI included) checks the same examples, so a failure reproduces wherever it appears;
# explore further locally with a larger max_examples and derandomize=False
CONTRACT = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def run_conv_add_linear(backend: Backend) -> torch.Tensor:
    """A small conv -> add -> flatten -> linear network on ``backend``, dequantized (what a CNN head does)."""
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 1, 4, 4, (3, 3), (6, 6), True, True, True), (0, 255), 0)
    out_qp = output_qparams(float_conv(layer, spec))
    y = run_conv_quantized(backend, layer, spec, out_qp, relu=True)
    y = backend.add(y, y, out_qp, out_qp, out_qp, relu=False).flatten(1)
    dense = make_layer((1, 144), (10, 144), qrange=(0, 255), per_channel=True, bias=True, seed=0)
    packed = backend.prepack_linear(dense.q_w, dense.w_qp, dense.bias)
    return backend.dequantize(backend.linear(y, packed, out_qp, out_qp, relu=False), out_qp)


def assert_export_matches_eager(model: torch.nn.Module, example_shape: tuple[int, ...], op: str, path: Path) -> None:
    """Convert ``model`` for fbgemm, export it to ``path`` and check that the TorchScript file - loaded under the
    engine it was made for, as docs/cli.md says - records ``op`` (the engine's own kernel, not a C loop) and gives
    the eager model's outputs exactly, on a batch size other than the example's."""
    import fxquant
    from fxquant.kernels.torch_engines.engine import quantized_engine

    torch.manual_seed(0)
    prepared = fxquant.prepare(model.eval(), (torch.randn(example_shape),))
    fxquant.calibrate(prepared, [torch.randn(4, *example_shape[1:]) for _ in range(3)], progress=False)
    qmodel = fxquant.convert(prepared, backend="fbgemm")
    x = torch.randn(5, *example_shape[1:])
    with quantized_engine("fbgemm"):  # torch re-packs the weights with the process's engine at load
        exported = torch.jit.load(str(fxquant.export(qmodel, path)))
    assert op in str(exported.inlined_graph)
    assert torch.equal(exported(x), qmodel(x))

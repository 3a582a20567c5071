"""fbgemm's and qnnpack's convs and Linears on AMX tiles (``conv_u8``), against the engines' own kernels, bit for bit.

The loop must give fbgemm's bytes exactly (a traced export records fbgemm's conv): every geometry it takes - 1-,
2- and 3-d, kernel sizes, strides, paddings wider than half the kernel, one input or output channel, channel counts
that are not multiples of 4 or 16, output widths that leave partial 16-position blocks, an odd number of blocks -
with and without ReLU and bias, zero points at both ends, and full-range inputs and weights (every u8*s8 pair sum
beyond int16).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kernel_contract_cases import assert_export_matches_eager
from torch import nn

import fxquant
from fxquant import native
from fxquant.kernels.base import ConvSpec, PackedWeight
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.kernels.torch_engines.amx_conv import NativeConv, native_conv
from fxquant.native.isa import cpu_sums_int8_exactly, has_amx_int8, has_avx2, has_vnni, isa_level
from fxquant.qparams import INT8_RANGE, REDUCED_UINT8_RANGE, UINT8_RANGE, QParams

ENGINES = [name for name in ("fbgemm", "qnnpack") if name in available_backends()]
pytestmark = pytest.mark.skipif("fbgemm" not in ENGINES, reason="no fbgemm engine in this torch build")
CONV_LOOP = native.loops is not None and has_amx_int8()  # elsewhere the engine's convs (tested below)
ROW_LOOP = native.loops is not None and has_vnni()  # the few-row Linear loop needs AVX512-VNNI only
AVX2_ROWS = native.loops is not None and not has_vnni() and has_avx2()  # else fbgemm's Linears take its AVX2 form
# fbgemm picks its kernel by the CPU, not by FXQUANT_ISA: where the cap hides VNNI the CPU has, the engine's Linear
# sums exactly while the AVX2 loop mirrors its 16-bit pair sums, which saturate on 8-bit inputs only; so there the
# two are compared on the 7-bit inputs the capped fbgemm backend gives (activation_qrange)
SEVEN_BIT_ONLY = AVX2_ROWS and cpu_sums_int8_exactly()
WHY_NOT = f"this process has {'no C extension' if native.loops is None else 'ISA ' + isa_level()}"
needs_tiles = pytest.mark.skipif(not CONV_LOOP, reason=f"the conv loop needs AMX-INT8; {WHY_NOT}")


def _weight_qp(channels: int, gen: torch.Generator) -> QParams:
    scales = torch.rand(channels, generator=gen) * 0.01 + 1e-3
    return QParams(scales, torch.zeros(channels, dtype=torch.long), *INT8_RANGE, axis=0)


def _both(cin: int, cout: int, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
          size: tuple[int, ...], *, batch: int = 2, extreme: bool = False, relu: bool = True, bias: bool = True,
          zero_points: tuple[int, int] = (37, 120), seed: int = 0, layout: str = "channels_last",
          engine: str = "fbgemm") -> tuple[torch.Tensor, torch.Tensor, PackedWeight]:
    """One conv through the C loop and through the engine's op (the same packed weight without the loop)."""
    backend, gen = get_backend(engine), torch.Generator().manual_seed(seed)
    if extreme:
        q_w = (torch.randint(0, 2, (cout, cin, *kernel), generator=gen) * 255 - 128).to(torch.int8)
        levels = torch.randint(0, 2, (batch, cin, *size), generator=gen) * 255
    else:
        q_w = torch.randint(-128, 128, (cout, cin, *kernel), generator=gen).to(torch.int8)
        levels = torch.randint(0, 256, (batch, cin, *size), generator=gen)
    in_qp = QParams(torch.tensor(0.02), torch.tensor(zero_points[0]), *UINT8_RANGE)
    out_qp = QParams(torch.tensor(3.0 if extreme else 0.3), torch.tensor(zero_points[1]), *UINT8_RANGE)
    a = backend.quantize((levels - zero_points[0]).float() * 0.02, in_qp)
    if layout != "contiguous":  # channels last, as a conv before it returns it
        a = a.movedim(1, -1).contiguous().movedim(-1, 1)
    if layout == "sliced":  # every other row and a column off: strides the loop's padded copy must follow
        a = torch.cat([a, a], 2).movedim(1, -1).contiguous().movedim(-1, 1)[:, :, ::2, 1:]
    dim = len(kernel)
    spec = ConvSpec(dim, stride, padding, (1,) * dim, 1, False, (0,) * dim)
    b = torch.randn(cout, generator=gen) * 5 if bias else None
    packed = backend.prepack_conv(q_w, _weight_qp(cout, gen), b, spec, in_qp=in_qp)
    loop = packed.payload[2]
    assert (loop is not None) == CONV_LOOP
    op = dataclasses.replace(packed, payload=(*packed.payload[:2], None))
    ran: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "conv_into", _counting(native.conv_into, "conv", ran))
        got = backend.conv(a, packed, in_qp, out_qp, relu=relu)
    out_size = [(n + 2 * p - k) // s + 1 for n, p, k, s in zip(size, padding, kernel, stride, strict=True)]
    assert loop is not None and ran == (["conv"] if loop.takes(batch * math.prod(out_size)) else [])
    return got, backend.conv(a, op, in_qp, out_qp, relu=relu), packed


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point())
    assert torch.equal(got.int_repr(), want.int_repr())


# (C_in, C_out, kernel, stride, padding, input size)
CASES = [
    (3, 16, (3, 3), (1, 1), (1, 1), (16, 20)),  # an RGB stem: 4 padded channels, 12-byte kernel rows
    (16, 16, (3, 3), (1, 1), (1, 1), (9, 33)),  # 33 positions per row: a block of one
    (32, 16, (3, 3), (1, 1), (1, 1), (8, 8)),
    (64, 64, (3, 3), (2, 2), (1, 1), (13, 11)),
    (128, 32, (1, 1), (1, 1), (0, 0), (5, 7)),  # two 64-byte chunks
    (3, 64, (7, 7), (2, 2), (3, 3), (23, 19)),  # a ResNet stem
    (1, 1, (3, 3), (1, 1), (1, 1), (6, 6)),
    (5, 17, (1, 3), (1, 2), (0, 1), (7, 9)),  # 17 outputs: a partial 16-channel block
    (8, 70, (3, 1), (2, 1), (2, 0), (10, 5)),  # 70 outputs: an odd number of column blocks
    (70, 24, (2, 2), (1, 1), (0, 0), (6, 6)),  # 72 padded channels: 48-byte chunks
    (16, 2, (5, 5), (1, 1), (4, 4), (3, 4)),  # padding beyond half the kernel
    (16, 32, (5,), (1,), (2,), (37,)),  # 1-d (audio)
    (3, 8, (3,), (2,), (0,), (50,)),
    (8, 16, (3, 3, 3), (1, 1, 1), (1, 1, 1), (4, 6, 7)),  # 3-d (video, volumes)
    (4, 17, (1, 3, 2), (2, 1, 2), (0, 1, 1), (5, 4, 9)),
]


@needs_tiles
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-k{c[2]}-s{c[3]}-p{c[4]}" for c in CASES])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_the_conv_loop_gives_the_engines_bits(case: tuple, extreme: bool, relu: bool, engine: str) -> None:
    got, want, _ = _both(*case, extreme=extreme, relu=relu, engine=engine)
    _same(got, want)
    assert got.stride() == want.stride()  # channels last, as fbgemm returns it


@needs_tiles
@pytest.mark.parametrize("layout", ["sliced", "contiguous"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zero_points", [(0, 0), (255, 255), (128, 3)])
@pytest.mark.parametrize("engine", ENGINES)
def test_strided_inputs_no_bias_and_zero_points_at_the_ends(layout: str, bias: bool, zero_points: tuple[int, int],
                                                            engine: str) -> None:
    got, want, _ = _both(16, 32, (3, 3), (1, 1), (1, 1), (10, 21), layout=layout, bias=bias, zero_points=zero_points,
                         engine=engine)
    _same(got, want)


# (input shape, out features): AMX tiles (16+ rows, 2**20+ multiply-adds), the VNNI row loop (fewer rows, a tiny
# layer), a 3-d input, C_out not a multiple of 16, C_in not a multiple of 4; for the AVX2 loop (one row at a time
# against each 64-channel block) 2, 3 and 7 rows, a C_out that ends inside a block and 8 past a 16-channel one
LINEARS = [((64, 256), 128), ((40, 96), 48), ((3, 7, 64), 17), ((128, 256), 10), ((4, 1024), 64), ((1, 784), 256),
           ((5, 33), 20), ((2, 130), 70), ((7, 61), 136), ((3, 1000), 33)]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Linears take the loops on one thread only (with more, the engines' split Linears won at two)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("shape", "out_features"), LINEARS, ids=[f"{s}-{n}" for s, n in LINEARS])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("engine", ENGINES)
def test_the_linear_loop_gives_the_engines_bits(shape: tuple[int, ...], out_features: int, extreme: bool,
                                                engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = math.prod(shape[:-1])
    expected = _linear_path(rows, rows * shape[-1] * out_features, engine)
    if expected is None:
        pytest.skip(f"{engine} keeps its own Linear for {rows} rows here: {WHY_NOT}")
    ran: list[str] = []
    for name in ("conv_into", "linear_rows_into"):
        monkeypatch.setattr(native, name, _counting(getattr(native, name), name, ran))
    backend, gen = get_backend(engine), torch.Generator().manual_seed(len(shape) + out_features)
    top = 127 if SEVEN_BIT_ONLY else 255
    q_w = torch.randint(-128, 128, (out_features, shape[-1]), generator=gen).to(torch.int8)
    levels = torch.randint(0, 2, shape, generator=gen) * top if extreme else \
        torch.randint(0, top + 1, shape, generator=gen)
    if extreme:
        q_w = torch.where(q_w < 0, -128, 127).to(torch.int8)
    in_qp = QParams(torch.tensor(0.02), torch.tensor(90), *UINT8_RANGE)
    a = backend.quantize((levels - 90).float() * 0.02, in_qp)
    packed = backend.prepack_linear(q_w, _weight_qp(out_features, gen), torch.randn(out_features, generator=gen),
                                    in_qp=in_qp)
    op = dataclasses.replace(packed, payload=(packed.payload[0], None))
    # a 7-bit output range: the loop saturates at 127 itself, where the op is followed by a clamp
    for out_range, relu in itertools.product((UINT8_RANGE, REDUCED_UINT8_RANGE), (False, True)):
        out_qp = QParams(torch.tensor(2.0 if extreme else 0.2), torch.tensor(30), *out_range)
        _same(backend.linear(a, packed, in_qp, out_qp, relu=relu), backend.linear(a, op, in_qp, out_qp, relu=relu))
    assert ran == [expected] * 4


def _linear_path(rows: int, macs: int, engine: str) -> str | None:
    """Which loop a Linear takes, as docs/amx.md states the measured rule: with AMX, tiles from 16 rows and 2**20
    multiply-adds and the VNNI row loop below; with VNNI only, the row loop below 16 rows (fbgemm: below 8 rows or
    2**22 multiply-adds); with AVX2 alone, fbgemm's within the same limits; else None (the engine's Linear)."""
    if CONV_LOOP:
        return "conv_into" if rows >= 16 and macs >= 1 << 20 else "linear_rows_into"
    if ROW_LOOP and rows < 16 and (engine == "qnnpack" or rows < 8 or macs < 1 << 22):
        return "linear_rows_into"
    if AVX2_ROWS and rows < 16 and engine == "fbgemm" and (rows < 8 or macs < 1 << 22):
        return "linear_rows_into"
    return None


def _counting(fn: Callable[..., bool], name: str, ran: list[str]) -> Callable[..., bool]:
    def counted(*args: object, **kwargs: object) -> bool:
        ran.append(name)
        return fn(*args, **kwargs)
    return counted


@needs_tiles
def test_the_loop_is_taken_where_measured_faster() -> None:
    """fbgemm: every conv; qnnpack: from ~2**17 multiply-adds (the engines' own kernels win below); a Linear on every
    row count, on the tiles from 16 rows and 2**20 multiply-adds, on the VNNI row loop below (``NativeConv.takes``,
    ``NativeConv.tiled``)."""
    gen = torch.Generator().manual_seed(0)
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1, False, (0, 0))
    conv = native_conv(torch.ones(8, 8, 3, 3, dtype=torch.int8), _weight_qp(8, gen), None, spec)
    qconv = native_conv(torch.ones(8, 8, 3, 3, dtype=torch.int8), _weight_qp(8, gen), None, spec, engine="qnnpack")
    rows = dataclasses.replace(spec, dim=1, stride=(1,), padding=(0,), dilation=(1,), output_padding=(0,))
    linear = native_conv(torch.ones(256, 512, 1, dtype=torch.int8), _weight_qp(256, gen), None, rows, linear=True)
    assert conv is not None and qconv is not None and linear is not None
    assert conv.takes(1)
    assert not qconv.takes(16) and qconv.takes(4096)
    assert linear.takes(8) and not linear.tiled(8)  # the row loop: 16-row tiles would be half empty
    assert linear.takes(16) and linear.tiled(16)


def test_the_convs_it_does_not_take_keep_fbgemm() -> None:
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1, False, (0, 0))
    gen = torch.Generator().manual_seed(1)
    weight, w_qp = torch.ones(8, 8, 3, 3, dtype=torch.int8), _weight_qp(8, gen)
    per_tensor = QParams(torch.tensor(0.01), torch.tensor(0), *INT8_RANGE)
    with_zero_points = dataclasses.replace(w_qp, zero_point=torch.ones(8, dtype=torch.long))
    assert native_conv(weight, per_tensor, None, spec) is None
    assert native_conv(weight, with_zero_points, None, spec) is None
    assert native_conv(weight[:, :4], w_qp, None, dataclasses.replace(spec, groups=2)) is None
    assert native_conv(weight, w_qp, None, dataclasses.replace(spec, dilation=(2, 2))) is None
    assert native_conv(weight, w_qp, None, dataclasses.replace(spec, transposed=True)) is None
    assert (native_conv(weight, w_qp, None, spec) is not None) == CONV_LOOP


def test_an_exported_model_records_fbgemm_convs_and_computes_what_eager_does(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 24, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(24, 5, 1))
    assert_export_matches_eager(model, (2, 3, 20, 20), "quantized::conv2d", tmp_path / "model.pt")


def test_the_exported_file_names_its_engine(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).eval()
    prepared = fxquant.prepare(model, (torch.randn(1, 3, 9, 9),))
    fxquant.calibrate(prepared, [torch.randn(2, 3, 9, 9)], progress=False)
    path = fxquant.export(fxquant.convert(prepared, backend="fbgemm"), tmp_path / "model.pt")
    extra = {"fxquant.json": ""}
    torch.jit.load(str(path), _extra_files=extra)
    assert json.loads(extra["fxquant.json"]) == {"engine": "fbgemm"}



def test_fxquant_native_0_turns_the_loops_off() -> None:
    """The escape hatch documented in docs/amx.md: a process started with it runs the engines' kernels only."""
    code = "import fxquant.native as n; print(n.loops is None)"
    env = {**os.environ, "FXQUANT_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def _rule_layers() -> tuple[NativeConv | None, ...]:
    """A small and a large fbgemm Linear, a large qnnpack Linear and a conv, as ``native_conv`` lays them out here."""
    gen = torch.Generator().manual_seed(0)
    rows = ConvSpec(1, (1,), (0,), (1,), 1, False, (0,))
    small = native_conv(torch.ones(256, 512, 1, dtype=torch.int8), _weight_qp(256, gen), None, rows, linear=True)
    big = native_conv(torch.ones(1024, 1024, 1, dtype=torch.int8), _weight_qp(1024, gen), None, rows, linear=True)
    qbig = native_conv(torch.ones(1024, 1024, 1, dtype=torch.int8), _weight_qp(1024, gen), None, rows, linear=True,
                       engine="qnnpack")
    conv = native_conv(torch.ones(8, 8, 3, 3, dtype=torch.int8), _weight_qp(8, gen), None,
                       ConvSpec(2, (1, 1), (1, 1), (1, 1), 1, False, (0, 0)))
    return small, big, qbig, conv


@pytest.mark.skipif(not ROW_LOOP or CONV_LOOP, reason=f"the VNNI-only rule applies where AMX is not: {WHY_NOT}")
def test_without_amx_linears_take_the_row_loop_below_the_measured_limits() -> None:
    small, big, qbig, conv = _rule_layers()
    assert small is not None and big is not None and qbig is not None and conv is None
    assert small.takes(8) and not small.takes(16) and not small.tiled(8)
    assert big.takes(4) and not big.takes(8) and qbig.takes(15) and not qbig.takes(16)


@pytest.mark.skipif(not AVX2_ROWS, reason=f"the AVX2 rule applies where VNNI is not: {WHY_NOT}")
def test_with_avx2_alone_fbgemm_linears_take_the_row_loop_within_fbgemms_vnni_limits() -> None:
    """Its 16-bit pair sums are fbgemm's own (the same pairs saturate alike on 8-bit inputs, tested above), not
    qnnpack's exact ones: qnnpack keeps its kernel, and convs keep the engines' (docs/amx.md)."""
    small, big, qbig, conv = _rule_layers()
    assert small is not None and big is not None and qbig is None and conv is None and not big.vnni
    assert small.takes(15) and not small.takes(16) and big.takes(7) and not big.takes(8) and not big.tiled(4)


@pytest.mark.skipif(native.loops is None, reason="no C extension in this install")
def test_a_cpu_with_avx_vnni_alone_runs_neither_row_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Intel's client cores: int8 sums are exact, so activations are 8-bit, which the AVX2 loop's 16-bit pair sums
    would saturate where qnnpack's kernel does not; and the VNNI loop needs AVX512-VNNI itself."""
    from fxquant.kernels.torch_engines import amx_conv

    monkeypatch.setattr(amx_conv, "has_amx_int8", lambda: False)
    monkeypatch.setattr(amx_conv, "has_vnni", lambda: True)
    monkeypatch.setattr(amx_conv, "has_avx512_vnni", lambda: False)
    monkeypatch.setattr(amx_conv, "has_avx2", lambda: True)
    assert _rule_layers() == (None, None, None, None)


class _SmallNet(nn.Module):
    """Convs, a depthwise conv (the onednn backend's AVX2 depthwise loop), a SiLU and Linears (the AMX and VNNI
    loops' layers), and a channel concat of two INT8 branches: its row copies (``native.concat``) run on every backend
    and ISA level, so at one thread some loop always runs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.left, self.right = nn.Conv2d(16, 8, 3, padding=1), nn.Conv2d(16, 8, 1)
        self.fc1, self.fc2 = nn.Linear(16 * 8 * 8, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.depthwise(torch.relu(self.stem(x))))
        y = nn.functional.silu(torch.cat([torch.relu(self.left(y)), torch.relu(self.right(y))], 1))
        return self.fc2(torch.relu(self.fc1(torch.flatten(y, 1))))


class _CountingLoops:
    """Counts every call into the C extension, whoever makes it: each of its functions is wrapped in place."""

    def __init__(self, extension: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name, fn in vars(extension).items():
            if isinstance(fn, types.BuiltinFunctionType):
                monkeypatch.setattr(extension, name, self._counted(name, fn))

    def _counted(self, name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: object) -> object:
            self.calls.append(name)
            return fn(*args)
        return counted


@pytest.mark.skipif(native.loops is None, reason="no C extension in this install")
@pytest.mark.parametrize("backend", [b for b in ("fbgemm", "qnnpack", "onednn") if b in available_backends()])
def test_at_eight_threads_no_one_thread_loop_runs_and_outputs_stay(backend: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread rule (``native.THREAD_LIMITS``, docs/amx.md): above a loop family's measured limit the engine's
    kernel, split over torch's threads, runs instead. The same model at one thread does call loops (the counter
    works) and gives the same bytes, since each loop computes what the kernel it replaces computes."""
    prepared = fxquant.prepare(_SmallNet().eval(), (torch.randn(1, 3, 8, 8),))
    fxquant.calibrate(prepared, [torch.randn(4, 3, 8, 8) for _ in range(2)], progress=False)
    qmodel = fxquant.convert(prepared, backend=backend)
    x = torch.randn(2, 3, 8, 8)
    counter = _CountingLoops(native.loader.extension, monkeypatch)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        with torch.inference_mode():
            many = qmodel(x)
        at_eight = list(counter.calls)
        torch.set_num_threads(1)
        with torch.inference_mode():
            one = qmodel(x)
    finally:
        torch.set_num_threads(previous)
    assert at_eight == [], at_eight
    assert len(counter.calls) > 0, "the counter saw no loop at one thread either: the test would prove nothing"
    assert torch.equal(many, one)

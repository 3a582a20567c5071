"""The C loops behind U-Net decoders on fbgemm, against the torch ops they replace, bit for bit.

``patches_u8`` runs a transposed conv whose kernel equals its stride (an upsampler) as fbgemm's quantized Linear
computes it and writes each input position's patch in place: compared with fbgemm's Linear plus depth-to-space
(what a TorchScript export records, so export and eager must agree exactly) on every path of the loop - AMX tiles
(32-row blocks, whole 16-column blocks), the VNNI rows around them, strided inputs, output channels that are not a
multiple of 16, inputs whose channel count is not a multiple of 4 - at full-range inputs and weights, where 16-bit
pair sums would saturate. Both run at the loop's thread limit (``native.THREAD_LIMITS``): above it fbgemm's Linear
runs on both sides. ``copy_rows`` concatenates one-byte activations; compared with ``torch.cat``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from kernel_contract_cases import assert_export_matches_eager, loop_threads
from torch import nn

from fxquant import native
from fxquant.kernels.base import ConvSpec
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.native.isa import has_vnni
from fxquant.qparams import INT8_RANGE, UINT8_RANGE, QParams

FBGEMM = "fbgemm" in available_backends()
needs_fbgemm = pytest.mark.skipif(not FBGEMM, reason="the fbgemm engine is not in this torch build")
# the loop needs the C extension and an AVX512-VNNI CPU; elsewhere the backend keeps fbgemm's Linear (tested too)
LOOP = native.loops is not None and has_vnni()


def _qp(scale: float, zero_point: int, qrange: tuple[int, int] = UINT8_RANGE) -> QParams:
    return QParams(torch.tensor(scale), torch.tensor(zero_point), *qrange)


def _upsample(cin: int, cout: int, kernel: tuple[int, ...], size: tuple[int, ...], *, batch: int = 2,
              extreme: bool = False, bias: bool = True, seed: int = 0, layout: str = "channels_last",
              zero_points: tuple[int, int] = (37, 120)) -> tuple[torch.Tensor, torch.Tensor]:
    """The fbgemm backend's transposed conv of one random case, through the C loop and through fbgemm's Linear."""
    backend = get_backend("fbgemm")
    gen = torch.Generator().manual_seed(seed)
    if extreme:  # inputs and weights at their ends: every u8*s8 pair sum is beyond int16
        q_w = (torch.randint(0, 2, (cin, cout, *kernel), generator=gen) * 255 - 128).to(torch.int8)
        levels = torch.randint(0, 2, (batch, cin, *size), generator=gen) * 255
    else:
        q_w = torch.randint(-128, 128, (cin, cout, *kernel), generator=gen).to(torch.int8)
        levels = torch.randint(0, 256, (batch, cin, *size), generator=gen)
    in_qp, w_qp = _qp(0.02, zero_points[0]), _qp(0.003, 0, INT8_RANGE)
    out_qp = _qp(0.9 if extreme else 0.25, zero_points[1])
    a = backend.quantize((levels - zero_points[0]).float() * 0.02, in_qp)
    if layout == "channels_last" and a.dim() == 4:
        a = a.contiguous(memory_format=torch.channels_last)
    elif layout == "channels_last":  # a conv1d's output: (N, L, C) in memory
        a = a.movedim(1, -1).contiguous().movedim(-1, 1)
    elif layout == "sliced":  # every other image row of a taller input: rows at two strides
        tall = torch.cat([a, a], 2).contiguous(memory_format=torch.channels_last)
        a = tall[:, :, ::2]
    spec = ConvSpec(len(kernel), kernel, (0,) * len(kernel), (1,) * len(kernel), 1, True, (0,) * len(kernel))
    packed = backend.prepack_conv_transpose(q_w, w_qp, torch.randn(cout, generator=gen) * 3 if bias else None, spec)
    assert (packed.payload.native is not None) == LOOP
    linear = dataclasses.replace(packed, payload=dataclasses.replace(packed.payload, native=None))
    with loop_threads("upsample"):
        got = backend.conv_transpose(a, packed, in_qp, out_qp)
        want = backend.conv_transpose(a, linear, in_qp, out_qp)
    return got, want


# (C_in, C_out, kernel, input size): U-Net's three upsamplers, then each path of the loop
CASES = [
    (128, 64, (2, 2), (8, 8)),  # AMX: 32-row blocks, K in two 64-byte chunks
    (64, 32, (2, 2), (16, 16)),
    (32, 16, (2, 2), (5, 7)),  # 70 rows: two AMX blocks and 6 VNNI rows
    (16, 16, (1, 1), (9, 4)),  # one 16-column block: a single weight tile
    (96, 16, (2, 2), (6, 6)),  # 48-byte chunks
    (100, 32, (2, 2), (6, 6)),  # 20-byte chunks
    (6, 5, (2, 2), (5, 5)),  # C_in not a multiple of 4, C_out not of 16: VNNI with a row buffer
    (3, 48, (3, 3), (4, 3)),  # 9 patches
    (64, 8, (4, 4), (3, 2)),
    (32, 16, (2, 1), (7, 9)),
    (24, 16, (2,), (40,)),  # 1-d
    (5, 7, (4,), (11,)),
]


@needs_fbgemm
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
@pytest.mark.parametrize("extreme", [False, True])
def test_the_upsampler_loop_gives_fbgemm_linear_bits(case: tuple, extreme: bool) -> None:
    cin, cout, kernel, size = case
    got, want = _upsample(cin, cout, kernel, size, extreme=extreme)
    assert got.shape == want.shape and got.q_scale() == want.q_scale()
    assert got.q_zero_point() == want.q_zero_point()
    assert torch.equal(got.int_repr(), want.int_repr())
    assert got.stride(1) == 1  # channels last, what the next fbgemm conv reads without a copy


@needs_fbgemm
@pytest.mark.parametrize("layout", ["sliced", "contiguous"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zero_points", [(0, 0), (255, 255), (128, 3)])
def test_strided_inputs_no_bias_and_zero_points_at_the_ends(layout: str, bias: bool, zero_points: tuple[int, int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Contiguous (NCHW) inputs are made channels-last and then take the loop too: it must run here."""
    calls: list[int] = []
    patches_into = native.patches_into

    def counted(*args: object) -> bool:
        calls.append(1)
        return patches_into(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "patches_into", counted)
    got, want = _upsample(32, 16, (2, 2), (8, 12), layout=layout, bias=bias, zero_points=zero_points, seed=3)
    assert torch.equal(got.int_repr(), want.int_repr())
    assert len(calls) == (1 if LOOP else 0)


@pytest.mark.skipif(not LOOP or not FBGEMM, reason="the C loop needs AVX512-VNNI and the C extension")
def test_the_loop_writes_every_output_byte() -> None:
    """Outputs start as uninitialised memory: fill it with a marker first and check none is left where the loop
    should have written (a skipped row block or column tile would leave it)."""
    backend = get_backend("fbgemm")
    loop = backend.prepack_conv_transpose(torch.ones(32, 16, 2, 2, dtype=torch.int8), _qp(0.01, 0, INT8_RANGE),
                                          None, ConvSpec(2, (2, 2), (0, 0), (1, 1), 1, True, (0, 0))).payload.native
    a = torch.zeros(3, 32, 7, 11, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    out = torch.full((3, 14, 22, 16), 77, dtype=torch.uint8).movedim(-1, 1)
    done = native.patches_into(out, a, loop.weight, loop.column_sums, loop.bias, 16, (1.0, 1.0), (0, 5), (2, 2))
    assert done and bool((out == 5).all())  # zero inputs: every output is the output zero point


@needs_fbgemm
def test_a_traced_export_records_the_linear_and_computes_what_eager_does(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(32, 16, 2, stride=2),
                          nn.Conv2d(16, 4, 1))
    assert_export_matches_eager(model, (2, 3, 12, 12), "quantized::linear", tmp_path / "model.pt")


# concatenation: (shapes, dim, layout)
CATS: list[tuple[list[tuple[int, ...]], int, str]] = [
    ([(2, 16, 5, 6), (2, 8, 5, 6)], 1, "channels_last"),
    ([(2, 3, 5, 6), (2, 70, 5, 6), (2, 1, 5, 6)], 1, "channels_last"),  # a row wider than 64 bytes
    ([(1, 4, 2, 3, 3), (1, 12, 2, 3, 3)], 1, "channels_last"),
    ([(2, 16, 9), (2, 8, 9)], 1, "channels_last"),  # conv1d outputs
    ([(2, 16, 5, 6), (2, 8, 5, 6)], 1, "contiguous"),
    ([(2, 4, 5, 6), (3, 4, 5, 6)], 0, "contiguous"),
    ([(2, 4, 5, 6), (2, 4, 5, 2)], -1, "contiguous"),
    ([(2, 4, 0, 6), (2, 3, 0, 6)], 1, "contiguous"),
]


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        return t.movedim(1, -1).contiguous().movedim(-1, 1)
    return t.contiguous()


@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize("case", CATS, ids=[f"{c[1]}-{c[2]}-{len(c[0][0])}d-{i}" for i, c in enumerate(CATS)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_row_copies_concatenate_like_torch_cat(case: tuple, dtype: torch.dtype) -> None:
    shapes, dim, layout = case
    gen = torch.Generator().manual_seed(len(shapes))
    values = [_laid_out(torch.randint(-128, 128, s, generator=gen).to(dtype), layout) for s in shapes]
    out = native.concat(values, dim, lambda shape: torch.empty(shape, dtype=dtype))
    if native.loops is None:
        assert out is None  # the torch path then
        return
    assert out is not None and torch.equal(out, torch.cat(values, dim))
    assert out.stride(1) == 1 if layout == "channels_last" else out.is_contiguous()  # the inputs' layout


@pytest.mark.parametrize("values", [
    [torch.zeros(2, 3, 4, dtype=torch.uint8), torch.zeros(2, 3, 5, dtype=torch.uint8)],  # sizes differ off dim
    [torch.zeros(2, 3, 4, dtype=torch.uint8), torch.zeros(2, 3, 4, dtype=torch.int8)],  # dtypes differ
    [torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)],  # not one byte
    [torch.zeros(2, 4, 6, dtype=torch.uint8)[:, :, ::2], torch.zeros(2, 4, 3, dtype=torch.uint8)],  # strided
])
def test_what_row_copies_do_not_take_is_left_to_torch_cat(values: list[torch.Tensor]) -> None:
    """None, and nothing allocated: torch.cat then runs (or raises its own error for mismatched sizes)."""
    made: list[list[int]] = []

    def empty(shape: list[int]) -> torch.Tensor:
        made.append(shape)
        return torch.empty(shape, dtype=values[0].dtype)

    assert native.concat(values, 1, empty) is None
    assert made == []


@needs_fbgemm
@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize("name", [n for n in ("fbgemm", "qnnpack") if n in available_backends()])
def test_a_quantized_cat_keeps_the_grid_and_the_bytes(name: str) -> None:
    backend, qp = get_backend(name), _qp(0.05, 17)
    values = [backend.quantize(torch.randn(2, c, 6, 5), qp).contiguous(memory_format=torch.channels_last)
              for c in (16, 24)]
    out = backend.cat(values, [qp, qp], qp, 1)
    want = torch.cat(values, 1)
    assert (out.q_scale(), out.q_zero_point()) == (want.q_scale(), want.q_zero_point())
    assert torch.equal(out.int_repr(), want.int_repr())
    assert out.is_contiguous(memory_format=torch.channels_last)

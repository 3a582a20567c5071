"""The kernels of the float-in, float-out schemes against independent references.

- ``quantize_rows`` (dynamic per-token activations): its properties (range, one 127 per row, error within half a
  step, zero rows), with the C loops and without them.
- ``per_token_linear`` (dynamic W8A8) bit for bit against rows quantized in torch's steps (times SmoothQuant's input
  scale, where there is one), integer sums made in float64 from them (exact: every sum here is an integer far below
  2**53) and then the kernel's float32 steps in the kernel's order.
- The weight-only C loop (``weight_only_into``), on its AVX-512 and AVX2 paths, and ``weight_only_linear``'s
  dequantize-in-blocks path, against a float64 reference within what float32 accumulation can be off by
  (:func:`_tolerance` says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_contract_cases import cpu_flags, loop_threads, require_c_loops

from fxquant import native
from fxquant.kernels import per_token as per_token_kernel
from fxquant.kernels import weight_only as weight_only_kernel
from fxquant.kernels.per_token import per_token_linear, quantize_rows
from fxquant.kernels.weight_only import BLOCK, LOOP_ROWS, weight_only_linear
from fxquant.native.isa import ISA_LEVELS, isa_cap
from fxquant.native.per_token import int8_rows_into, quantize_rows_into, rescale_rows_into
from fxquant.native.weight_only import weight_only_into

U = 2.0**-24  # float32's unit roundoff: every float32 operation's relative error is at most this


def _int8_weights(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense int8 weights with both extremes present (-128 too: fxquant's symmetric weight qparams span
    [-amax, amax] over 255 steps, so a row whose largest magnitude is negative holds -128) and a positive float32
    scale per output."""
    weight = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int64).to(torch.int8)
    weight[:, 0] = 127
    weight[:, -1] = -128 if in_features > 1 else weight[:, -1]
    scale = torch.rand(out_features, generator=gen) * 0.02 + 1e-3
    return weight, scale


def _bias(out_features: int, gen: torch.Generator, with_bias: bool) -> torch.Tensor | None:
    return torch.randn(out_features, generator=gen) if with_bias else None


# --- quantize_rows ------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize(("rows", "width"), [(1, 1), (3, 17), (8, 64), (5, 1000)])
def test_quantize_rows_properties(rows: int, width: int) -> None:
    x = torch.randn(rows, width) * torch.logspace(-3, 3, rows)[:, None]  # rows of very different magnitudes
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (rows, 1)
    assert int(q.min()) >= -127 and int(q.max()) <= 127  # symmetric: -128 never appears
    assert torch.equal(q.abs().amax(dim=1).long(), torch.full((rows,), 127))  # each row's largest value maps to 127
    # q = round(fl(x / s)), and fl(x / s) is within |x / s| * U <= 127 * U of x / s: so |x - q s| <= s (1/2 + 127 U)
    error = (x.double() - q.double() * scale.double()).abs()
    bound = scale.double() * (0.5 + 127 * U)
    assert bool((error <= bound).all()), f"worst error {float((error / scale.double()).max()):.6f} steps"


@pytest.mark.usefixtures("native_loops")
def test_quantize_rows_zero_row() -> None:
    x = torch.randn(3, 20)
    x[1] = 0.0
    q, scale = quantize_rows(x)
    assert torch.equal(q[1], torch.zeros(20, dtype=torch.int8))
    assert bool(torch.isfinite(scale).all()) and float(scale[1]) > 0
    assert int(q[0].abs().max()) == 127 and int(q[2].abs().max()) == 127  # the other rows are unaffected


def _torch_quantized_rows(rows: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 of ``rows * input_scale`` in torch's steps, written out here (not fxquant's code)."""
    rows = rows if input_scale is None else rows * input_scale
    scale = rows.abs().amax(dim=1, keepdim=True).div(127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.div(rows, scale).round().clamp(-127, 127).to(torch.int8), scale


def _input_scale(in_features: int, gen: torch.Generator, smoothed: bool) -> torch.Tensor | None:
    """SmoothQuant's 1/s per input channel: factors over two decades, as an LLM's smoothing spreads them."""
    return torch.logspace(-1, 1, in_features)[torch.randperm(in_features, generator=gen)] if smoothed else None


@pytest.mark.parametrize("smoothed", [False, True])
def test_quantize_rows_c_loop_gives_the_torch_bytes(loop_path: str, smoothed: bool) -> None:
    """The C pass (where the loops run, on its AVX-512 and its compiler-vectorized path) against torch's steps: the
    same int8 rows and the same scales, with and without SmoothQuant's input scale applied in the pass."""
    x = torch.randn(6, 77)
    x[2] = 0.0
    wide = torch.randn(6, 100)
    wide[:, :77] = x
    input_scale = _input_scale(77, torch.Generator().manual_seed(10), smoothed)
    for rows in (x, wide[:, :77]):  # dense, and rows further apart than their width
        q, scale = torch.empty(rows.shape, dtype=torch.int8), torch.empty(6, 1)
        with loop_threads("elementwise"):
            assert quantize_rows_into(q, scale, rows, input_scale), "the C loop did not run"
        want_q, want_scale = _torch_quantized_rows(rows, input_scale)
        assert torch.equal(scale, want_scale) and torch.equal(q, want_q)


# --- per_token_linear ---------------------------------------------------------------------------------------------
def _per_token_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The rows (times ``input_scale``) quantized in torch's steps, integer sums in float64 (exact: |sum| <= K * 127
    * 128 < 2**53), rounded to float32 as an int32 would be, then ``acc * row_scale * weight_scale + bias`` in
    float32 in that order."""
    q, scale = _torch_quantized_rows(x.reshape(-1, weight.shape[1]).to(torch.float32), input_scale)
    acc = (q.double() @ weight.double().t()).to(torch.float32)
    out = acc * scale * weight_scale
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


PER_TOKEN_SHAPES = [((1, 64), 32), ((5, 33), 17), ((3, 1), 9), ((1, 1), 1), ((9, 130), 40), ((2, 7, 48), 24),
                    ((4, 3, 5), 8)]


@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize(("x_shape", "out_features"), PER_TOKEN_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_sums", [True, False], ids=["weight_sums", "no_sums"])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
def test_per_token_linear_is_exact(x_shape: tuple[int, ...], out_features: int, with_bias: bool,
                                   with_sums: bool, smoothed: bool) -> None:
    gen = torch.Generator().manual_seed(sum(x_shape) * out_features)
    x = torch.randn(x_shape, generator=gen) * 3
    weight, scale = _int8_weights(out_features, x_shape[-1], gen)
    bias = _bias(out_features, gen, with_bias)
    sums = weight.sum(dim=1, dtype=torch.int32) if with_sums else None
    input_scale = _input_scale(x_shape[-1], gen, smoothed)
    with loop_threads("int8_rows"):
        got = per_token_linear(x, weight, scale, bias, weight_sums=sums, input_scale=input_scale)
    assert got.shape == (*x_shape[:-1], out_features) and got.dtype == torch.float32
    assert torch.equal(got, _per_token_reference(x, weight, scale, bias, input_scale))


def test_per_token_linear_zero_row_gives_the_bias() -> None:
    x = torch.randn(3, 40)
    x[1] = 0.0
    weight, scale = _int8_weights(12, 40, torch.Generator().manual_seed(1))
    bias = torch.randn(12)
    got = per_token_linear(x, weight, scale, bias, weight_sums=weight.sum(dim=1, dtype=torch.int32))
    assert not bool(got.isnan().any())
    assert torch.equal(got[1], bias)


@pytest.mark.parametrize("x_shape", [(1, 48), (2, 5, 48)])
def test_per_token_linear_bfloat16_in_bfloat16_out(x_shape: tuple[int, ...]) -> None:
    x = torch.randn(x_shape).to(torch.bfloat16)
    weight, scale = _int8_weights(20, 48, torch.Generator().manual_seed(2))
    bias = torch.randn(20)
    got = per_token_linear(x, weight, scale, bias, weight_sums=weight.sum(dim=1, dtype=torch.int32))
    assert got.dtype == torch.bfloat16 and got.shape == (*x_shape[:-1], 20)
    assert torch.equal(got, _per_token_reference(x, weight, scale, bias))


def test_per_token_c_loops_run_and_give_the_torch_bytes() -> None:
    """The rescale pass and the few-row VNNI Linear (quantize, sums and rescale in one call), called directly: they
    ran, and wrote the reference's bytes."""
    require_c_loops()
    gen = torch.Generator().manual_seed(3)
    rows = per_token_kernel.LOOP_ROWS
    x = torch.randn(rows, 131, generator=gen)
    weight, scale = _int8_weights(21, 131, gen)
    bias = torch.randn(21, generator=gen)
    input_scale = _input_scale(131, gen, True)
    q, row_scale = quantize_rows(x)
    want = _per_token_reference(x, weight, scale, bias)
    acc = (q.double() @ weight.double().t()).to(torch.int32)
    out = torch.full((rows, 21), float("nan"))
    with loop_threads("elementwise"):
        assert rescale_rows_into(out, acc, row_scale, scale, bias), "the C rescale did not run"
    assert torch.equal(out, want)
    if "avx512_vnni" not in cpu_flags() or isa_cap() < ISA_LEVELS.index("vnni"):
        pytest.skip("the VNNI rows loop needs AVX512-VNNI, which this CPU (or FXQUANT_ISA) does not allow")
    sums = weight.sum(dim=1, dtype=torch.int32)
    for smoothing in (None, input_scale):  # the quantize, VNNI sums and rescale of one call, then SmoothQuant's too
        out = torch.full((rows, 21), float("nan"))
        with loop_threads("int8_rows"):
            ran = int8_rows_into(out, x, weight, sums, scale, bias, smoothing)
        assert ran, "the VNNI rows loop did not run on a CPU with AVX512-VNNI"
        assert torch.equal(out, _per_token_reference(x, weight, scale, bias, smoothing))


def test_per_token_linear_takes_the_vnni_rows_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """With weight sums, up to its LOOP_ROWS rows run on the VNNI rows loop (which ran), more on torch._int_mm."""
    require_c_loops()
    if "avx512_vnni" not in cpu_flags() or isa_cap() < ISA_LEVELS.index("vnni"):
        pytest.skip("the VNNI rows loop needs AVX512-VNNI, which this CPU (or FXQUANT_ISA) does not allow")
    returned: list[bool] = []

    def spy(*args: Any) -> bool:
        returned.append(int8_rows_into(*args))
        return returned[-1]

    monkeypatch.setattr(per_token_kernel, "int8_rows_into", spy)
    gen = torch.Generator().manual_seed(9)
    weight, scale = _int8_weights(13, 70, gen)
    sums = weight.sum(dim=1, dtype=torch.int32)
    loop_rows = per_token_kernel.LOOP_ROWS
    for rows in (1, loop_rows, loop_rows + 1):
        x = torch.randn(rows, 70, generator=gen)
        with loop_threads("int8_rows"):
            got = per_token_linear(x, weight, scale, None, weight_sums=sums)
        assert torch.equal(got, _per_token_reference(x, weight, scale, None)), rows
    assert returned == [True, True], returned  # the loop for 1 and LOOP_ROWS rows, not for one row more


def _at_threads(threads: int, fn: Any) -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("rows", [1, 3, 600])  # a decode step (the few-row loops) and a prefill (quantize, rescale)
def test_loops_split_over_threads_give_the_one_thread_bytes(rows: int) -> None:
    """The loops split their outputs (or rows) over torch's OpenMP threads where the work is large enough: at two
    threads each output is still one thread's arithmetic, so the bytes are the one-thread bytes (and the dynamic
    ones the exact reference's)."""
    require_c_loops()
    if min(native.THREAD_LIMITS[family] for family in ("int8_rows", "weight_only", "elementwise")) < 2:
        pytest.skip("a thread limit keeps the loops off at two threads")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(rows, 576, generator=gen)
    weight, scale = _int8_weights(200, 576, gen)  # 115200 weights: enough to be split
    group_scale = torch.rand(200, 9, generator=gen) * 0.02 + 1e-3
    sums, input_scale = weight.sum(dim=1, dtype=torch.int32), _input_scale(576, gen, True)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = per_token_linear(x, weight, scale, None, weight_sums=sums, input_scale=input_scale)
        return dynamic, weight_only_linear(x, weight, group_scale, None, input_scale=input_scale)

    one, two = _at_threads(1, run), _at_threads(2, run)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert torch.equal(two[0], _per_token_reference(x, weight, scale, None, input_scale))


# --- weight-only --------------------------------------------------------------------------------------------------
def _weight_only_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 result and the tolerance of a float32 computation of it, per output.

    Every float32 operation rounds with a relative error of at most U = 2**-24, and the products x * w are exact in
    float32's fused multiply-adds and in float64. A sum of K terms in any order (lanes, blocks, a tail) rounds at
    most K - 1 times, each rounding off by U times a partial sum, which is at most sum|terms|: so it is within
    (K - 1) U sum|x w| (Higham's gamma bound to first order). Scaling the sum (or each dequantized weight, on the
    GEMM path) and adding the bias round twice more: (K + 1) U (sum|x w| scale + |bias|) bounds all of it; the
    tolerance takes twice that, (K + 1) * 2**-23, for the second-order terms."""
    x64, w64 = x.double(), weight.double()
    groups = scale.shape[1] if scale.dim() == 2 else 1  # one scale per output, or per group of inputs of each
    s64 = scale.double().reshape(weight.shape[0], groups).repeat_interleave(weight.shape[1] // groups, dim=1)
    out = x64 @ (w64 * s64).t()
    magnitude = x64.abs() @ (w64 * s64).abs().t()  # the scaled weights round once more: within the factor 2 below
    if bias is not None:
        out = out + bias.double()
        magnitude = magnitude + bias.double().abs()
    return out, (weight.shape[1] + 1) * 2 * U * magnitude


def _assert_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> None:
    want, tol = _weight_only_reference(x, weight, scale, bias)
    error = (got.double() - want).abs()
    assert bool((error <= tol).all()), f"worst error / tolerance {float((error / tol).max()):.3f}"


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def loop_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """One of the C loop's three paths: the ISA capped so that it is the one taken (restored afterwards), or a skip
    where this CPU cannot take it."""
    require_c_loops()
    flags = cpu_flags()
    path = str(request.param)
    if path == "avx512" and not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        pytest.skip("the AVX-512 path needs avx512f, avx512bw and avx512vl, which this CPU lacks")
    if path == "avx512" and isa_cap(strict=False) < ISA_LEVELS.index("avx512"):
        pytest.skip("FXQUANT_ISA caps the loops below avx512")
    if path == "avx2" and not {"avx2", "fma"} <= flags:
        pytest.skip("the AVX2 path needs avx2 and fma, which this CPU lacks")
    if path == "scalar" and {"avx2", "fma"} <= flags:
        pytest.skip("the scalar path runs only on a CPU without AVX2+FMA; this one has them, and FXQUANT_ISA "
                    "cannot cap the loops below avx2")
    native.loader.set_isa_cap(ISA_LEVELS.index("avx512") if path == "avx512" else 0)
    try:
        yield path
    finally:
        native.loader.set_isa_cap(isa_cap(strict=False))  # what fxquant.native set at load


WEIGHT_ONLY_SHAPES = [(1, 1, 1), (1, 16, 8), (2, 15, 9), (3, 17, 5), (LOOP_ROWS, 64, 24), (5, 100, 13),
                      (4, 7, 1), (7, 259, 33), (6, 8, 16), (1, 2000, 17)]


@pytest.mark.parametrize(("rows", "in_features", "out_features"), WEIGHT_ONLY_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_weight_only_loop(loop_path: str, rows: int, in_features: int, out_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features * 10 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight, scale = _int8_weights(out_features, in_features, gen)
    bias = _bias(out_features, gen, with_bias)
    out = torch.full((rows, out_features), float("nan"))
    with loop_threads("weight_only"):
        assert weight_only_into(out, x, weight, scale, bias), "the C loop did not run"
    _assert_close(out, x, weight, scale, bias)


@pytest.mark.parametrize(("rows", "in_features", "out_features", "group"),
                         [(1, 128, 24, 64), (3, 192, 17, 16), (LOOP_ROWS, 1536, 40, 64), (2, 64, 9, 64)])
def test_weight_only_loop_with_a_scale_per_group(loop_path: str, rows: int, in_features: int, out_features: int,
                                                 group: int) -> None:
    """WeightOnlyInt8Linear's layout: one scale per ``group`` inputs of each output, (out_features, groups)."""
    gen = torch.Generator().manual_seed(in_features + group)
    x = torch.randn(rows, in_features, generator=gen)
    weight, _ = _int8_weights(out_features, in_features, gen)
    scale = torch.rand(out_features, in_features // group, generator=gen) * 0.02 + 1e-3
    out = torch.full((rows, out_features), float("nan"))
    with loop_threads("weight_only"):
        assert weight_only_into(out, x, weight, scale, None), "the C loop did not run"
    _assert_close(out, x, weight, scale, None)
    gemm = weight_only_linear(x.repeat(LOOP_ROWS + 1, 1), weight, scale, None)[:rows]  # above LOOP_ROWS: the GEMM
    _assert_close(gemm, x, weight, scale, None)


@pytest.mark.parametrize("rows", [1, LOOP_ROWS, LOOP_ROWS + 1])  # the loop, and the GEMM above LOOP_ROWS
def test_weight_only_linear_smoothed(loop_path: str, rows: int) -> None:
    """SmoothQuant's input scale multiplies the rows first (in the C loop, or before the GEMM): the result is the
    float64 reference's on the float32 products ``x * input_scale``, as torch's mul rounds them."""
    gen = torch.Generator().manual_seed(11 + rows)
    x = torch.randn(rows, 192, generator=gen)
    weight, _ = _int8_weights(30, 192, gen)
    scale = torch.rand(30, 3, generator=gen) * 0.02 + 1e-3
    input_scale = _input_scale(192, gen, True)
    bias = torch.randn(30, generator=gen)
    with loop_threads("weight_only"):
        got = weight_only_linear(x, weight, scale, bias, input_scale=input_scale)
    _assert_close(got, x * input_scale, weight, scale, bias)


def test_weight_only_loop_strided_rows_and_outputs(loop_path: str) -> None:
    """Inputs whose rows lie further apart than their width, written into every other row of a wider output: the
    loop reads and writes through the strides and touches nothing else."""
    gen = torch.Generator().manual_seed(4)
    wide_x = torch.randn(5, 60, generator=gen)
    x = wide_x[:, 3:44]
    weight, scale = _int8_weights(19, 41, gen)
    bias = torch.randn(19, generator=gen)
    wide_out = torch.full((5, 30), float("nan"))
    with loop_threads("weight_only"):
        assert weight_only_into(wide_out[:, :19], x, weight, scale, bias), "the C loop did not run"
    _assert_close(wide_out[:, :19], x, weight, scale, bias)
    assert bool(wide_out[:, 19:].isnan().all()), "the loop wrote past its outputs"


def test_the_isa_cap_selects_another_path() -> None:
    """The AVX-512 path sums 16 lanes, the AVX2 path 8: float32 rounds their sums differently, so with many terms the
    two caps give different bytes (both within the tolerance). Equal bytes would mean the cap changed nothing and
    the AVX2 tests above ran the AVX-512 path."""
    require_c_loops()
    if not {"avx512f", "avx512bw", "avx512vl", "avx2", "fma"} <= cpu_flags():
        pytest.skip("needs a CPU with both the AVX-512 and the AVX2 paths")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4000, generator=gen)
    weight, scale = _int8_weights(64, 4000, gen)
    results = []
    try:
        for level in (ISA_LEVELS.index("avx512"), 0):
            native.loader.set_isa_cap(level)
            out = torch.empty(3, 64)
            with loop_threads("weight_only"):
                assert weight_only_into(out, x, weight, scale, None), "the C loop did not run"
            _assert_close(out, x, weight, scale, None)
            results.append(out)
    finally:
        native.loader.set_isa_cap(isa_cap(strict=False))
    assert not torch.equal(results[0], results[1])


def test_weight_only_loop_yields_above_the_thread_limit() -> None:
    require_c_loops()
    x = torch.randn(2, 32)
    weight, scale = _int8_weights(8, 32, torch.Generator().manual_seed(6))
    out = torch.full((2, 8), float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(native.THREAD_LIMITS["weight_only"] + 1)
    try:
        assert not weight_only_into(out, x, weight, scale, None)
    finally:
        torch.set_num_threads(previous)
    assert bool(out.isnan().all()), "nothing may be written when the loop yields"
    with loop_threads("weight_only"):  # the control: at the limit, the same call runs
        assert weight_only_into(out, x, weight, scale, None)


class _Spy:
    """Wraps ``weight_only_into`` to record what each call returned."""

    def __init__(self) -> None:
        self.returned: list[bool] = []

    def __call__(self, *args: Any) -> bool:
        ran = weight_only_into(*args)
        self.returned.append(ran)
        return ran


# rows, in_features, out_features: one block; three blocks of BLOCK // in_features outputs (the last one shorter)
LINEAR_SHAPES = [(LOOP_ROWS + 1, 96, 40), (3 * LOOP_ROWS, 2048, 2 * (BLOCK // 2048) + 76), (1, 2048, 1100)]


@pytest.mark.parametrize(("rows", "in_features", "out_features"), LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("loops", ["c_loops", "off"])
def test_weight_only_linear(monkeypatch: pytest.MonkeyPatch, rows: int, in_features: int, out_features: int,
                            with_bias: bool, loops: str) -> None:
    """Above LOOP_ROWS rows, or with the loops off, the weights are dequantized a block at a time into F.linear."""
    if loops == "c_loops":
        require_c_loops()
    else:
        monkeypatch.setattr(native, "loops", None)
    spy = _Spy()
    monkeypatch.setattr(weight_only_kernel, "weight_only_into", spy)
    gen = torch.Generator().manual_seed(rows + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight, scale = _int8_weights(out_features, in_features, gen)
    bias = _bias(out_features, gen, with_bias)
    with loop_threads("weight_only"):
        got = weight_only_linear(x, weight, scale, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    _assert_close(got, x, weight, scale, bias)
    loop_ran = rows <= LOOP_ROWS and loops == "c_loops"
    assert (spy.returned == [True]) if loop_ran else (True not in spy.returned), spy.returned


def test_weight_only_linear_takes_the_loop_up_to_loop_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    require_c_loops()
    spy = _Spy()
    monkeypatch.setattr(weight_only_kernel, "weight_only_into", spy)
    gen = torch.Generator().manual_seed(7)
    weight, scale = _int8_weights(24, 50, gen)
    for rows in range(1, LOOP_ROWS + 1):
        x = torch.randn(rows, 50, generator=gen)
        with loop_threads("weight_only"):
            got = weight_only_linear(x, weight, scale, None)
        _assert_close(got, x, weight, scale, None)
    assert spy.returned == [True] * LOOP_ROWS


@pytest.mark.usefixtures("native_loops")
@pytest.mark.parametrize("x_shape", [(1, 1, 40), (2, 7, 40)])  # a decode step (the loop) and a prefill (blocks)
def test_weight_only_linear_3d_and_bfloat16(x_shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(x_shape, generator=gen)
    weight, scale = _int8_weights(12, 40, gen)
    bias = torch.randn(12, generator=gen)
    with loop_threads("weight_only"):
        got = weight_only_linear(x, weight, scale, bias)
        got_bf16 = weight_only_linear(x.to(torch.bfloat16), weight, scale, bias)
    assert got.shape == (*x_shape[:-1], 12)
    _assert_close(got.reshape(-1, 12), x.reshape(-1, 40), weight, scale, bias)
    assert got_bf16.dtype == torch.bfloat16 and got_bf16.shape == got.shape
    x_bf16 = x.to(torch.bfloat16).float().reshape(-1, 40)  # the values the kernel receives
    want, tol = _weight_only_reference(x_bf16, weight, scale, bias)
    error = (got_bf16.reshape(-1, 12).double() - want).abs()
    bound = tol + want.abs() * 2.0**-8  # plus the final rounding to bfloat16 (8 significant bits)
    assert bool((error <= bound).all()), f"worst error / bound {float((error / bound).max()):.3f}"


@pytest.mark.parametrize("in_features", [1, 100, per_token_kernel.EXACT_RUN + 37])
def test_per_token_linear_is_exact_where_int_mm_is_not(monkeypatch: pytest.MonkeyPatch, in_features: int) -> None:
    """Where torch._int_mm saturates (oneDNN without VNNI sums pairs of products in int16) the sums come from float32
    GEMMs over runs of EXACT_RUN inputs: still the exact reference, across more than one run."""
    monkeypatch.setattr(per_token_kernel, "int_mm_is_exact", lambda: False)
    gen = torch.Generator().manual_seed(in_features)
    x = torch.randn(5, in_features, generator=gen) * 3
    weight, scale = _int8_weights(11, in_features, gen)
    weight[:, :2] = -128  # the largest products the sums can meet
    assert torch.equal(per_token_linear(x, weight, scale, None), _per_token_reference(x, weight, scale, None))

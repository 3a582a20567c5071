"""The C loops for element-wise int8 ops on plain uint8 activations, against independent references.

The global average pool (``mean_u8``, or torch without it) against integer arithmetic by hand:
``round_half_even(sum(q - zero_point) / count) + zero_point``, clamped to the range. The product (``mul_u8``, SE
gates) against the torch path's own float arithmetic bit for bit, and the float product within one step."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_contract_cases import CONTRACT, loop_threads, require_c_loops

from fxquant.kernels.plain_int8 import _native_global_mean
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.qparams import QParams

PLAIN = [n for n in ("onednn", "reference") if n in available_backends()]


def _by_hand(q: torch.Tensor, qp: QParams) -> torch.Tensor:
    """Python's ``round`` of a Fraction rounds half to even, exactly."""
    zero_point = int(qp.zero_point)
    flat = q.reshape(q.shape[0], q.shape[1], -1).tolist()
    means = [[min(max(round(Fraction(sum(v - zero_point for v in row), len(row))) + zero_point, qp.qmin), qp.qmax)
              for row in sample] for sample in flat]
    return torch.tensor(means, dtype=torch.uint8).reshape(*q.shape[:2], *(1,) * (q.dim() - 2))


def _laid_out(q: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last" and q.dim() == 4:
        return q.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last" and q.dim() == 3:  # what a conv1d run as a conv2d of height one returns
        return q.unsqueeze(2).contiguous(memory_format=torch.channels_last).squeeze(2)
    if layout == "sliced":  # every other channel of a wider tensor: strided channels
        wide = torch.zeros((q.shape[0], 2 * q.shape[1], *q.shape[2:]), dtype=q.dtype)
        wide[:, ::2] = q
        return wide[:, ::2]
    return q


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.usefixtures("native_loops")
@given(batch=st.integers(1, 3), channels=st.integers(1, 9), spatial=st.lists(st.integers(1, 7), min_size=1, max_size=3),
       zero_point=st.integers(0, 255), narrow=st.booleans(), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["contiguous", "channels_last", "sliced"]))
@CONTRACT
def test_global_average_pool_is_the_rounded_mean(name: str, batch: int, channels: int, spatial: list[int],
                                                 zero_point: int, narrow: bool, seed: int, layout: str) -> None:
    qmax = 127 if narrow else 255
    zero_point = min(zero_point, qmax)
    qp = QParams(torch.tensor(0.1), torch.tensor(zero_point), 0, qmax)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, qmax + 1, (batch, channels, *spatial), generator=gen, dtype=torch.int64).to(torch.uint8)
    if q[0, 0].numel() % 2 == 0:  # an exact tie in the first mean: half to even decides
        q[0, 0].view(-1)[:] = torch.tensor([zero_point % 2 + 1, zero_point % 2 + 2]).repeat(q[0, 0].numel() // 2)
    x = _laid_out(q, layout)
    got = get_backend(name).adaptive_avg_pool(x, qp, 1)
    assert got.shape == (batch, channels, *(1,) * len(spatial))
    assert torch.equal(got, _by_hand(q, qp))


@pytest.mark.parametrize(("shape", "layout"), [((2, 5, 4, 6), "channels_last"), ((2, 5, 4, 6), "contiguous"),
                                               ((1, 8, 33), "channels_last"), ((3, 4, 2, 3, 5), "contiguous")])
def test_the_c_mean_runs(shape: tuple[int, ...], layout: str) -> None:
    """The C loop takes the layouts models produce (it is not silently skipped) and is exact there."""
    require_c_loops()
    q = torch.randint(0, 256, shape, dtype=torch.int64).to(torch.uint8)
    qp = QParams(torch.tensor(0.02), torch.tensor(37), 0, 255)
    with loop_threads("elementwise"):
        got = _native_global_mean(_laid_out(q, layout), qp, 1)
    assert got is not None and torch.equal(got, _by_hand(q, qp))


@pytest.mark.parametrize("name", PLAIN)
def test_what_the_c_loop_does_not_take_runs_in_torch(name: str) -> None:
    """Other output sizes, a wrong number of them, and spatial memory one stride cannot walk (a transpose): the
    torch path, with the same result."""
    q = torch.randint(0, 256, (2, 3, 6, 5), dtype=torch.int64).to(torch.uint8)
    qp = QParams(torch.tensor(0.02), torch.tensor(37), 0, 255)
    for output_size in ((2, 3), (1, 1, 1), 2, (None, 1)):
        assert _native_global_mean(q, qp, output_size) is None
    transposed = q.transpose(2, 3)
    assert _native_global_mean(transposed, qp, 1) is None
    assert torch.equal(get_backend(name).adaptive_avg_pool(transposed, qp, 1), _by_hand(transposed, qp))


@pytest.mark.parametrize("name", PLAIN)
@given(batch=st.integers(1, 3), channels=st.integers(1, 9), spatial=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       gate=st.booleans(), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["contiguous", "channels_last", "sliced"]))
@CONTRACT
def test_the_c_mul_gives_the_torch_paths_bits(name: str, batch: int, channels: int, spatial: list[int], gate: bool,
                                              seed: int, layout: str) -> None:
    """The C product (an SE gate broadcast over positions, or two tensors of one shape) is the torch path's
    float32 (onednn) or float64 (reference) arithmetic exactly, and within one step of the float product."""
    from fxquant import native

    gen = torch.Generator().manual_seed(seed)
    shape = (batch, channels, *spatial)
    a = torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
    b = torch.randint(0, 256, shape[:2] + (1,) * len(spatial) if gate else shape, generator=gen,
                      dtype=torch.int64).to(torch.uint8)
    qa, qb, qout = (QParams(torch.rand((), generator=gen) * 0.1 + 0.001, torch.randint(0, 256, (), generator=gen),
                            0, 255) for _ in range(3))
    backend = get_backend(name)
    x = _laid_out(a, layout)
    with_c = backend.mul(x, b, qa, qb, qout)
    loops, native.loops = native.loops, None
    try:
        in_torch = backend.mul(x, b, qa, qb, qout)
    finally:
        native.loops = loops
    assert torch.equal(with_c, in_torch)
    want = backend.quantize(backend.dequantize(a, qa) * backend.dequantize(b, qb), qout)
    assert int((with_c.int() - want.int()).abs().max()) <= 1


@pytest.mark.parametrize(("shape", "layout", "gate"), [((2, 5, 4, 6), "channels_last", True),
                                                       ((2, 5, 4, 6), "contiguous", False),
                                                       ((1, 8, 33), "contiguous", True)])
def test_the_c_mul_runs(shape: tuple[int, ...], layout: str, gate: bool) -> None:
    from fxquant.kernels.plain_int8 import _native_mul

    require_c_loops()
    a = _laid_out(torch.randint(0, 256, shape, dtype=torch.int64).to(torch.uint8), layout)
    b = torch.randint(0, 256, shape[:2] + (1,) * (len(shape) - 2) if gate else shape, dtype=torch.int64).to(torch.uint8)
    qp = QParams(torch.tensor(0.02), torch.tensor(37), 0, 255)
    with loop_threads("elementwise"):
        assert _native_mul(a, b, (qp, qp, qp), torch.float32) is not None


def test_more_positions_than_a_32_bit_sum_holds_run_in_torch() -> None:
    """A channel of 16,843,010 values of 255 would wrap the C loop's 32-bit sum: the torch path takes it."""
    q = torch.full((1, 1, (2**32 - 1) // 255 + 1), 255, dtype=torch.uint8)
    qp = QParams(torch.tensor(0.02), torch.tensor(0), 0, 255)
    assert _native_global_mean(q, qp, 1) is None
    assert int(get_backend("reference").adaptive_avg_pool(q, qp, 1)) == 255

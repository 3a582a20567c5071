"""The C max pool of channels-last uint8 (``fxquant/native/csrc/pool.c``, the onednn backend's pool): aten's max pool
of the same integers byte for byte, at channel counts around the vector width, at every thread count; the C loop
must have run where it applies, and the op must take over where it does not."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fxquant import native
from fxquant.kernels import recording
from fxquant.kernels.onednn import max_pool

pytestmark = pytest.mark.skipif(not native.available(), reason="needs fxquant's C loops (built, FXQUANT_NATIVE unset)")

WINDOWS: list[dict[str, Any]] = [
    {"kernel_size": 3, "stride": 2, "padding": 1},  # ResNet's stem pool
    {"kernel_size": 2},
    {"kernel_size": (3, 2), "stride": (1, 2), "padding": (1, 1), "dilation": (2, 1)},
    {"kernel_size": 3, "stride": 2, "ceil_mode": True},
    {"kernel_size": 2, "stride": 3, "padding": 1, "dilation": 3, "ceil_mode": True},
    {"kernel_size": 1, "stride": 1},
]


def _input(channels: int, seed: int) -> torch.Tensor:
    q = torch.randint(0, 256, (2, channels, 11, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return q.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("channels", [1, 3, 63, 64, 70, 200])
@pytest.mark.parametrize("window", WINDOWS)
def test_the_loop_gives_atens_bytes(channels: int, window: dict[str, Any]) -> None:
    q = _input(channels, channels)
    want = torch.nn.functional.max_pool2d(q.float().contiguous(), **window).to(torch.uint8)
    with recording.recording() as log:
        got = max_pool.channels_last_max_pool(q, 2, window)
    assert got is not None and torch.equal(got, want)
    assert got.is_contiguous(memory_format=torch.channels_last)
    ((run, source, destination, out),) = log  # the C loop ran, once, reading q where it is
    assert source == q.data_ptr() and destination == got.data_ptr() and out is got
    again = torch.empty_like(got)
    run(q.data_ptr(), again.data_ptr())  # the recorded call repeats the pool on the same addresses
    assert torch.equal(again, want)


@pytest.mark.parametrize("threads", [2, 8])
def test_threads_do_not_change_the_bytes(threads: int) -> None:
    q = torch.randint(0, 256, (4, 64, 112, 112), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    window = {"kernel_size": 3, "stride": 2, "padding": 1}
    before = torch.get_num_threads()
    one = max_pool.channels_last_max_pool(q, 2, window)
    try:
        torch.set_num_threads(threads)
        many = max_pool.channels_last_max_pool(q, 2, window)
    finally:
        torch.set_num_threads(before)
    assert one is not None and many is not None and torch.equal(one, many)
    assert torch.equal(one, torch.nn.functional.max_pool2d(q.float(), **window).to(torch.uint8))


def test_what_the_loop_does_not_take_goes_to_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    q = _input(8, 0)
    with recording.recording() as log:
        half = max_pool.channels_last_max_pool(q, 2, {"kernel_size": 2, "padding": 1})  # at most half: the loop
    assert half is not None and len(log) == 1
    with pytest.raises(RuntimeError, match="padding should be"):  # torch's own error for padding over half the window
        max_pool.channels_last_max_pool(q, 2, {"kernel_size": 2, "padding": 2})
    monkeypatch.setattr(native, "loops", None)  # FXQUANT_NATIVE=0
    with recording.recording() as log:
        got = max_pool.channels_last_max_pool(q, 2, WINDOWS[0])
    assert not log and got is not None
    assert torch.equal(got, torch.nn.functional.max_pool2d(q.float(), **WINDOWS[0]).to(torch.uint8))

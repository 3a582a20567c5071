"""Calls on raw addresses that a replay can repeat: what each kernel call executed while a recording is on.

:mod:`fxquant.runtime.replay` runs a stretch of a converted model once with a recording on, then repeats the logged
calls on later inputs without the Python around them. A kernel whose whole work is one C call reading one buffer and
writing another (a oneDNN primitive, fxquant's quantize and global-mean loops) logs it with :func:`record`; a kernel
that does anything else to a result (a clamp after the primitive) logs :func:`record_other`, so the replay knows the
call alone would not reproduce it. Nothing is logged, and nothing costs more than a thread-local read, while no
recording is on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

AddressCall = Callable[[int, int], None]  # run(source address, destination address), shapes fixed when made
# One executed call: its run, source and destination addresses and the destination tensor; None: some other
# operation on a result
Record = tuple[AddressCall, int, int, torch.Tensor] | None
_recorder = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list[Record]]:
    """Every call this thread records inside the block, in order."""
    log: list[Record] = []
    _recorder.log = log
    try:
        yield log
    finally:
        _recorder.log = None


def active() -> bool:
    """Whether this thread is recording (a kernel that must build its :data:`AddressCall` first checks this)."""
    return getattr(_recorder, "log", None) is not None


def record(run: AddressCall, src: int, out: torch.Tensor) -> None:
    """Log that ``run(src, out.data_ptr())`` computed ``out``, if this thread is recording."""
    log = getattr(_recorder, "log", None)
    if log is not None:
        log.append((run, src, out.data_ptr(), out))


def record_other() -> None:
    """Log, if recording, that something else changed a recorded call's result (it cannot be replayed)."""
    log = getattr(_recorder, "log", None)
    if log is not None:
        log.append(None)

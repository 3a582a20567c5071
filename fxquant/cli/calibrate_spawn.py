"""``fxquant calibrate --distributed N`` without torchrun: start N local ranks and wait for them.

Each rank is a ``spawn``-ed process given the environment torchrun would give it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``), so it runs exactly the torchrun code path
(:func:`fxquant.cli.calibrate_run.rank_main`). Threads are split between the ranks unless ``OMP_NUM_THREADS`` is set.
When a rank fails, the others are stopped at once (they would otherwise wait at the next collective until
``--dist-timeout``) and its one-line error becomes this command's error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from fxquant.cli.calibrate_run import free_port, rank_main
from fxquant.errors import CalibrationError, FxQuantError


def spawn_ranks(args: argparse.Namespace) -> int:
    """Run ``args.distributed`` ranks on this machine; 0 when all succeed, else raise with the first error."""
    import torch.multiprocessing as mp

    world = int(args.distributed)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world)}
    threads = max(1, (os.cpu_count() or 1) // world)
    errors = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_rank_entry, args=(args, env, threads, errors), nprocs=world, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        for process in context.processes:
            process.terminate()
        raise
    except mp.ProcessExitedException as exc:
        reported = _reported(errors)
        if exc.exit_code == 130 and not reported:
            raise KeyboardInterrupt from None
        raise CalibrationError(reported or f"rank {exc.error_index} stopped ({_exit_text(exc.exit_code)})") from None
    except mp.ProcessRaisedException as exc:
        # A rank that lost its peer raises from inside torch.distributed; the peer's own error says why.
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise CalibrationError(_reported(errors) or f"rank {exc.error_index} failed: "
                                                    f"{lines[-1] if lines else 'unknown error'}") from None
    return 0


def _reported(errors: Any) -> str:
    messages = []
    while not errors.empty():
        rank, message = errors.get()
        messages.append(f"rank {rank}: {message}")
    return "; ".join(messages)


def _exit_text(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"


def _rank_entry(rank: int, args: argparse.Namespace, env: dict[str, str], threads: int, errors: Any) -> None:
    """The body of one spawned rank: torchrun's environment, then the torchrun code path."""
    import torch

    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the rendezvous is on loopback; so are the ranks
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        rank_main(args, int(env["WORLD_SIZE"]))
    except FxQuantError as exc:
        errors.put((rank, " ".join(line.strip() for line in str(exc).splitlines() if line.strip())))
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)

"""``fxquant calibrate``: run data through a run's observers, in one process or several (``--distributed``).

One process (the default) calibrates every batch. ``--distributed N`` starts ``N`` local worker processes joined by
``torch.distributed`` (gloo on ``127.0.0.1``, or ``--dist-backend``); under ``torchrun`` (``RANK``/``WORLD_SIZE`` in
the environment) ``--distributed`` alone uses the processes torchrun started, on one machine or several. Every rank
rebuilds the run, reads the whole ``--data`` stream and calibrates the batches whose position ``i`` satisfies
``i % world_size == rank``; the observers are then merged across ranks (:mod:`fxquant.calibration.distributed`) and
rank 0 writes RUN_DIR exactly as a single-process run would (min/max statistics identical to it).

Checkpoints go to ``RUN_DIR/checkpoints/calibration.pt`` (one ``.rankR`` file per rank when distributed);
``--resume`` continues from them with the same number of processes.
"""

from __future__ import annotations

import argparse
import os

from fxquant.cli.calibrate_run import FROM_LAUNCHER, rank_main, single
from fxquant.cli.common import add_data_arguments, add_trust_arguments, positive_int
from fxquant.errors import InputError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    calibrate = sub.add_parser("calibrate", parents=[common], help="run data through the observers")
    calibrate.add_argument("run_dir", metavar="RUN_DIR")
    add_data_arguments(calibrate, split="train")
    calibrate.add_argument("--batches", type=positive_int, metavar="N", help="use at most N batches")
    calibrate.add_argument("--resume", action="store_true", help="continue an interrupted calibration")
    calibrate.add_argument("--checkpoint-every", type=positive_int, default=10, metavar="N",
                           help="checkpoint the statistics every N batches (default: 10)")
    calibrate.add_argument("--skip-nonfinite", action="store_true", help="skip batches with NaN/Inf")
    calibrate.add_argument("--distributed", nargs="?", const=FROM_LAUNCHER, type=positive_int, metavar="N",
                           help="calibrate in N local processes (torch.distributed), merging their statistics; "
                                "without N, use the processes torchrun started")
    calibrate.add_argument("--dist-backend", default="gloo", metavar="NAME",
                           help="torch.distributed backend for --distributed: gloo (CPU, default) or nccl")
    calibrate.add_argument("--dist-timeout", type=float, default=300.0, metavar="S",
                           help="seconds a rank waits for the others at a collective (default: 300)")
    add_trust_arguments(calibrate)
    calibrate.set_defaults(handler=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    world = _launcher_world()
    if args.distributed is None:
        if world > 1:
            raise InputError(f"this process is one of {world} started by torchrun: add --distributed, or run "
                             "fxquant calibrate without torchrun")
        return single(args)
    if world > 0:
        return rank_main(args, world)
    if args.distributed == FROM_LAUNCHER:
        raise InputError("--distributed without a process count needs a torchrun launch (RANK and WORLD_SIZE "
                         "set); give a count to start local processes, e.g. --distributed 2")
    if args.distributed == 1:
        return single(args)
    from fxquant.cli.calibrate_spawn import spawn_ranks

    return spawn_ranks(args)


def _launcher_world() -> int:
    """``WORLD_SIZE`` when torchrun (or :mod:`fxquant.cli.calibrate_spawn`) started this process, else 0."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise InputError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is not an integer") from None

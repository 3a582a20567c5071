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
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

from fxquant.cli.common import add_data_arguments, add_trust_arguments, data_options, emit, positive_int, trust_options
from fxquant.cli.data import load_data
from fxquant.cli.rundir import advance, open_run, rebuild_run
from fxquant.errors import CalibrationError, FxQuantError, InputError

CHECKPOINT = Path("checkpoints") / "calibration.pt"
_FROM_LAUNCHER = 0  # ``--distributed`` without a count: take the world from torchrun's environment


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    calibrate = sub.add_parser("calibrate", parents=[common], help="run data through the observers")
    calibrate.add_argument("run_dir", metavar="RUN_DIR")
    add_data_arguments(calibrate, split="train")
    calibrate.add_argument("--batches", type=positive_int, metavar="N", help="use at most N batches")
    calibrate.add_argument("--resume", action="store_true", help="continue an interrupted calibration")
    calibrate.add_argument("--checkpoint-every", type=positive_int, default=10, metavar="N",
                           help="checkpoint the statistics every N batches (default: 10)")
    calibrate.add_argument("--skip-nonfinite", action="store_true", help="skip batches with NaN/Inf")
    calibrate.add_argument("--distributed", nargs="?", const=_FROM_LAUNCHER, type=positive_int, metavar="N",
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
        return _single(args)
    if world > 0:
        return _rank_main(args, world)
    if args.distributed == _FROM_LAUNCHER:
        raise InputError("--distributed without a process count needs a torchrun launch (RANK and WORLD_SIZE "
                         "set); give a count to start local processes, e.g. --distributed 2")
    if args.distributed == 1:
        return _single(args)
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


def _run(args: argparse.Namespace, *, distributed: bool) -> tuple[Path, Any, Any, Any]:
    """Rebuild the run, calibrate it; returns (directory, manifest, prepared model, summary)."""
    from fxquant.calibration import calibrate

    directory, manifest = open_run(args.run_dir)
    data = load_data(data_options(args))
    prepared = rebuild_run(directory, manifest, trust_options(args), stage="prepared").model
    summary = calibrate(prepared, data, num_batches=args.batches, progress=not args.quiet,
                        skip_nonfinite=args.skip_nonfinite, checkpoint=directory / CHECKPOINT,
                        checkpoint_every=args.checkpoint_every, resume=args.resume, distributed=distributed)
    return directory, manifest, prepared, summary


def _commit(args: argparse.Namespace, run: tuple[Path, Any, Any, Any], world: int) -> None:
    """Write the calibrated statistics to RUN_DIR and report; the same for one process or many."""
    from fxquant.artifacts.model_io import observer_statistics
    from fxquant.state import quant_state

    directory, manifest, prepared, summary = run
    manifest.calibration_samples = quant_state(prepared).calibration_samples
    details: dict[str, Any] = {"world_size": world} if world > 1 else {}
    advance(directory, manifest, "calibrated", {"observers": observer_statistics(prepared)}, data=args.data,
            batches=summary.batches, samples=summary.samples, resumed_batches=summary.resumed_batches, **details)
    merged = f" (statistics merged from {world} processes)" if world > 1 else ""
    emit(args, f"{summary}\n{directory} is at stage 'calibrated'{merged}; next: fxquant convert {directory}",
         {"run_dir": str(directory), "stage": "calibrated", "batches": summary.batches, "samples": summary.samples,
          "seconds": summary.seconds, "resumed_batches": summary.resumed_batches, "world_size": world,
          "ranges": summary.ranges, "unobserved": summary.unobserved, "warnings": summary.warnings})


def _remove_checkpoint(path: Path) -> None:
    path.unlink(missing_ok=True)


def _remove_checkpoint_dir(directory: Path) -> None:
    folder = directory / CHECKPOINT.parent
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _single(args: argparse.Namespace) -> int:
    run = _run(args, distributed=False)
    _commit(args, run, 1)
    _remove_checkpoint(run[0] / CHECKPOINT)
    _remove_checkpoint_dir(run[0])
    return 0


def _rank_main(args: argparse.Namespace, world: int) -> int:
    """One rank of a distributed calibration; rank 0 commits RUN_DIR, every rank then drops its checkpoint."""
    import torch.distributed as dist

    if args.distributed not in (_FROM_LAUNCHER, world):
        raise InputError(f"--distributed {args.distributed}, but the launcher started {world} processes; pass "
                         f"--distributed {world} or --distributed alone")
    rank = int(os.environ["RANK"])
    if rank != 0:  # one copy of each warning and summary is enough
        logging.getLogger("fxquant").setLevel(logging.ERROR)
    try:
        dist.init_process_group(args.dist_backend, timeout=timedelta(seconds=args.dist_timeout))
    except (RuntimeError, ValueError) as exc:
        raise CalibrationError(f"--distributed: cannot join the process group ({_first_line(exc)})") from None
    try:
        run = _run(args, distributed=True)
        failure: list[str | None] = [None]
        if rank == 0:
            try:
                _commit(args, run, world)
            except FxQuantError as exc:
                failure[0] = str(exc)
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise CalibrationError(failure[0] if rank == 0 else "rank 0 could not write RUN_DIR")
        _remove_checkpoint(run[0] / CHECKPOINT.with_name(f"{CHECKPOINT.name}.rank{rank}"))
        dist.barrier()
        if rank == 0:
            _remove_checkpoint_dir(run[0])
    finally:
        dist.destroy_process_group()
    return 0


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def free_port() -> int:
    """A TCP port free on the loopback interface right now (for the local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

"""One process's part of ``fxquant calibrate``: the whole run alone (:func:`single`), or one rank of a distributed
run (:func:`rank_main`), started by torchrun or by :mod:`fxquant.cli.calibrate_spawn`."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

from fxquant.cli.common import data_options, emit, text_tokenizer, trust_options
from fxquant.cli.data import load_data
from fxquant.cli.rundir import advance, open_run, rebuild_run
from fxquant.cli.source import Source
from fxquant.errors import CalibrationError, FxQuantError, InputError

CHECKPOINT = Path("checkpoints") / "calibration.pt"
FROM_LAUNCHER = 0  # ``--distributed`` without a count: take the world from torchrun's environment


def _run(args: argparse.Namespace, *, distributed: bool) -> tuple[Path, Any, Any, Any]:
    """Rebuild the run, calibrate it; returns (directory, manifest, prepared model, summary)."""
    from fxquant.calibration import calibrate

    directory, manifest = open_run(args.run_dir)
    if args.seq_len is None:  # bad data fails before the (slower) rebuild
        data = load_data(data_options(args))
    rebuilt = rebuild_run(directory, manifest, trust_options(args), stage="prepared")
    prepared = rebuilt.graph
    if args.seq_len is not None:  # text: the tokenizer is the run's, opened once the run was authorized
        tokenizer = text_tokenizer(args, Source.from_manifest(directory, manifest).model, rebuilt.float_model)
        data = load_data(data_options(args), tokenizer)
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


def single(args: argparse.Namespace) -> int:
    run = _run(args, distributed=False)
    _commit(args, run, 1)
    _remove_checkpoint(run[0] / CHECKPOINT)
    _remove_checkpoint_dir(run[0])
    return 0


def rank_main(args: argparse.Namespace, world: int) -> int:
    """One rank of a distributed calibration; rank 0 commits RUN_DIR, every rank then drops its checkpoint."""
    import torch.distributed as dist

    if args.distributed not in (FROM_LAUNCHER, world):
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

"""A torchrun entry point for distributed calibration of a model given as ``PKG.MODULE:FACTORY``.

Every rank prepares the model, calibrates its shard of the data (``index % world_size``) and merges the observers
across ranks; rank 0 writes the merged statistics as a calibration checkpoint, which
:func:`fxquant.calibration.load_checkpoint` restores into a model prepared the same way. Example (loopback only)::

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 -m fxquant.cli.launch \\
        --model fxquant.models:digits_cnn --example-inputs 1x1x8x8 --data mypkg.data:batches --batches 64 \\
        -o stats.pt

Use ``--backend nccl`` on GPUs. ``--data`` is ``PKG.MODULE:FUNCTION`` returning an iterable of batches, or the
directory of a HF dataset saved with ``save_to_disk``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fxquant.calibration.checkpoint import Progress, save_checkpoint
from fxquant.calibration.loop import calibrate
from fxquant.calibration.observing import observers_of
from fxquant.errors import FxQuantError, InputError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun ... -m fxquant.cli.launch",
                                     description="Distributed calibration: each rank calibrates its shard, then "
                                                 "observers are merged; rank 0 writes the merged statistics.")
    parser.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY")
    parser.add_argument("--weights", metavar="FILE", help="state dict to load into the model")
    parser.add_argument("--example-inputs", required=True, metavar="SPEC", help="e.g. 1x3x224x224,1x10")
    parser.add_argument("--config", metavar="FILE", help="QuantConfig as .json/.yaml/.toml")
    parser.add_argument("--data", required=True, metavar="SPEC",
                        help="PKG.MODULE:FUNCTION returning an iterable of batches, or a save_to_disk directory")
    parser.add_argument("--batches", type=int, help="batches to use in total (all ranks together)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch for a HF dataset")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend: gloo (CPU) or nccl")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait for peers")
    parser.add_argument("-o", "--output", required=True, help="file for the merged statistics (rank 0 writes it)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    return parser


def _data(spec: str) -> Any:
    from fxquant.cli.specs import load_object

    if ":" not in spec and Path(spec).is_dir():
        import datasets

        return datasets.load_from_disk(spec)
    function = load_object(spec, "--data")
    if not callable(function):
        raise InputError(f"--data {spec!r} is not callable")
    return function()


def _calibrate(args: argparse.Namespace) -> str:
    from fxquant.api import prepare
    from fxquant.cli.specs import build_model, parse_example_inputs
    from fxquant.config import QuantConfig

    config = QuantConfig.from_file(args.config) if args.config else QuantConfig()
    model = build_model(args.model, args.weights)
    prepared = prepare(model, parse_example_inputs(args.example_inputs, model), config)
    summary = calibrate(prepared, _data(args.data), num_batches=args.batches, batch_size=args.batch_size,
                        progress=not args.quiet, distributed=True)
    if dist.get_rank() == 0:
        consumed = summary.batches + len(summary.skipped_batches)
        progress = Progress(consumed, summary.batches, summary.samples, summary.skipped_batches)
        save_checkpoint(args.output, observers_of(prepared), progress)
    return str(summary)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank; exit status 0 on success, 2 on bad input (one line on stderr)."""
    args = build_parser().parse_args(argv)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        text = _calibrate(args)
        if dist.get_rank() == 0 and not args.quiet:
            print(text)
        return 0
    except FxQuantError as exc:
        print(f"fxquant.cli.launch (rank {dist.get_rank()}): error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

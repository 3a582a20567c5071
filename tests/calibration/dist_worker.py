"""Run by ``torchrun`` in test_calibration_distributed.py: calibrate a shard, merge, save this rank's statistics."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from calib_helpers import MIXED_OBSERVERS, batches, observer_state, prepared_tiny

import fxquant


def main(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    prepared = prepared_tiny("histogram", **MIXED_OBSERVERS)
    summary = fxquant.calibrate(prepared, batches(), distributed=True, progress=False,
                                checkpoint=f"{out_dir}/calib.ckpt", checkpoint_every=2)
    result = {"state": observer_state(prepared), "batches": summary.batches, "samples": summary.samples}
    torch.save(result, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""Distributed calibration with two gloo processes on loopback (torchrun), compared with one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from calib_helpers import MIXED_OBSERVERS, assert_identical, batches, observer_state, prepared_tiny

import fxquant
from fxquant.calibration import load_checkpoint, observers_of
from fxquant.calibration.distributed import merged_observer
from fxquant.errors import CalibrationError
from fxquant.observers import HistogramObserver

HERE = Path(__file__).parent
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node 2`` on 127.0.0.1 only (gloo bound to the loopback interface)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def single_process() -> torch.fx.GraphModule:
    prepared = prepared_tiny("histogram", **MIXED_OBSERVERS)
    fxquant.calibrate(prepared, batches(), progress=False)
    return prepared


def test_two_ranks_merge_to_the_single_process_statistics(tmp_path: Path) -> None:
    torchrun(str(HERE / "dist_worker.py"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    reference = single_process()
    assert all(r["batches"] == len(batches()) and r["samples"] == 4 * len(batches()) for r in ranks)
    assert_identical(ranks[0]["state"], ranks[1]["state"])  # every rank ends with the same statistics
    assert (tmp_path / "calib.ckpt.rank0").exists() and (tmp_path / "calib.ckpt.rank1").exists()
    assert_identical(ranks[0]["state"], observer_state(reference))  # min/max and histogram counts: exact
    merged = prepared_tiny("histogram", **MIXED_OBSERVERS)
    for name, obs in observers_of(merged).items():
        obs.load_state_dict(ranks[0]["state"][name])
        expected, actual = observers_of(reference)[name].qparams(), obs.qparams()
        assert torch.equal(expected.scale, actual.scale) and torch.equal(expected.zero_point, actual.zero_point)


def test_launch_entry_point_writes_merged_statistics(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"activation": "histogram",
                                  "overrides": {k: {"activation": v} for k, v in MIXED_OBSERVERS.items()}}))
    out = tmp_path / "stats.pt"
    torchrun("-m", "fxquant.cli.launch", "--model", "calib_helpers:tiny_net", "--example-inputs",
             "4x3x8x8", "--config", str(config), "--data", "calib_helpers:batches", "--quiet", "-o", str(out))
    restored = prepared_tiny("histogram", **MIXED_OBSERVERS)
    progress = load_checkpoint(out, observers_of(restored))
    assert progress.batches == len(batches())
    assert_identical(observer_state(restored), observer_state(single_process()))


def test_merge_of_shards_in_process_equals_one_observer() -> None:
    data = batches(6)
    shards = [HistogramObserver() for _ in range(2)]
    single = HistogramObserver()
    for index, batch in enumerate(data):
        shards[index % 2](batch)
        single(batch)
    merged = merged_observer(HistogramObserver(), [s.state_dict() for s in shards])
    assert_identical({"h": merged.state_dict()}, {"h": single.state_dict()})


def test_distributed_without_a_process_group_is_a_clear_error() -> None:
    with pytest.raises(CalibrationError, match="init_process_group"):
        fxquant.calibrate(prepared_tiny("minmax"), batches(2), distributed=True, progress=False)

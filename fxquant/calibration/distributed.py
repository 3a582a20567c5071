"""Distributed calibration: every rank calibrates its shard, then observers are merged so all ranks agree.

Recipe (``torchrun --nproc_per_node 2 my_calibration.py``)::

    torch.distributed.init_process_group("gloo")          # "nccl" works the same way
    prepared = fxquant.prepare(model, example_inputs, config)
    summary = fxquant.calibrate(prepared, data, num_batches=64, distributed=True)
    # every rank now holds the same merged statistics; rank 0 converts and saves
    torch.distributed.destroy_process_group()

Sharding: with ``distributed=True``, ``calibrate`` gives rank ``r`` of ``w`` the batches whose position in the stream
satisfies ``index % w == r``, so every rank can iterate the same data; a DataLoader built with a
``DistributedSampler`` is already sharded and is used as is. Merging (:func:`merge_across_ranks`) gathers each
observer's ``state_dict()`` from every rank and folds them with ``Observer.merge`` in rank order, identically on
every rank: min/max statistics equal a single-process run's exactly, and histogram-family statistics too (the
canonical histogram grid makes the counts independent of how the data was split). ``moving_average`` merges by a
batch-weighted average (an EMA is order-dependent, so no merge rule reproduces one run exactly).

``python -m fxquant.cli.launch --help`` is a ready-made torchrun entry point for models and data given
as ``PKG.MODULE:FUNCTION``; it writes the merged statistics as a calibration checkpoint
(:func:`fxquant.calibration.checkpoint.load_checkpoint` restores them into a prepared model).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from fxquant.calibration.checkpoint import Progress, fingerprint
from fxquant.calibration.observing import observers_of
from fxquant.errors import CalibrationError
from fxquant.observers import Observer

StateDict = Mapping[str, Any]


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """This process's rank and the world size; ``CalibrationError`` when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise CalibrationError(
            "distributed calibration needs an initialised torch.distributed process group: launch with torchrun "
            "and call torch.distributed.init_process_group('gloo') (or 'nccl') before calibrate(distributed=True)")
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(value: Any, group: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def merged_observer(observer: Observer, states: list[StateDict]) -> Observer:
    """A copy of ``observer`` holding ``states`` (one per shard) merged in order with ``Observer.merge``."""
    total, part = copy.deepcopy(observer), copy.deepcopy(observer)
    total.load_state_dict(states[0])
    for state in states[1:]:
        part.load_state_dict(state)
        total.merge(part)
    return total


def merge_across_ranks(prepared: nn.Module, *, group: Any = None) -> None:
    """Replace every observer's statistics, on every rank, by the merge of all ranks' statistics.

    A collective: every rank of ``group`` (default: the whole world) must call it. Raises ``CalibrationError`` when
    the ranks' observer layouts differ (different models or configs). Example::

        with fxquant.observing(prepared):
            for batch in my_shard:
                prepared(batch)
        merge_across_ranks(prepared)
    """
    rank_and_world(group)
    observers = observers_of(prepared)
    local = {name: {k: v.detach().cpu() for k, v in obs.state_dict().items()} for name, obs in observers.items()}
    gathered = _all_gather((fingerprint(observers), local), group)
    if len({layout for layout, _ in gathered}) != 1:
        raise CalibrationError("ranks hold different observer layouts (different models or configs); prepare the "
                               "same model with the same config on every rank before merging")
    for name, obs in observers.items():
        obs.load_state_dict(merged_observer(obs, [states[name] for _, states in gathered]).state_dict())


def gather_progress(progress: Progress, *, group: Any = None) -> Progress:
    """The whole world's progress: summed counts, every rank's skipped batches, the furthest stream position."""
    parts = _all_gather(progress, group)
    skipped = sorted(i for p in parts for i in p.skipped)
    return Progress(max(p.position for p in parts), sum(p.batches for p in parts), sum(p.samples for p in parts),
                    skipped, progress.base_samples)


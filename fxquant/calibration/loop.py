"""The calibration loop: run real batches through a prepared model so its observers record ranges."""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx
from tqdm import tqdm

from fxquant.calibration.adapters import (
    Transform,
    batch_size_of,
    count_batches,
    forward_parameters,
    iterate_batches,
    to_call_args,
)
from fxquant.calibration.checkpoint import Progress, load_checkpoint, save_checkpoint
from fxquant.calibration.diagnostics import ChannelSpread, channel_spreads
from fxquant.calibration.distributed import gather_progress, merge_across_ranks, rank_and_world
from fxquant.calibration.observing import observing
from fxquant.calibration.summary import CalibrationSummary
from fxquant.errors import CalibrationError, ConfigError, FxQuantError, InputError
from fxquant.observers import Observer
from fxquant.state import STATE_KEY, update_state

log = logging.getLogger(__name__)

__all__ = ["CalibrationSummary", "calibrate"]


@dataclass(frozen=True)
class _Options:
    """The loop's settings, resolved once (ranks, per-rank sample budget, per-rank checkpoint path)."""

    num_batches: int | None
    max_samples: int | None
    progress: bool
    skip_nonfinite: bool
    transform: Transform | None
    diagnose: bool
    checkpoint: Path | None
    checkpoint_every: int
    resume: bool
    rank: int = 0
    world: int = 1
    shard: bool = False


def _finite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    values = (*args, *kwargs.values())
    return all(bool(torch.isfinite(v).all()) for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())


def _run_batch(prepared: fx.GraphModule, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        prepared(*args, **kwargs)
    except CalibrationError as exc:
        raise CalibrationError(f"batch {index}: {exc}") from None
    except FxQuantError:
        raise
    except Exception as exc:
        shapes = [tuple(v.shape) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"calibration batch {index} (tensor shapes {shapes}) does not fit the model: {reason}. "
                         "Check that the data matches the example inputs given to prepare().") from exc


class _Run:
    """One call of :func:`calibrate`: consumes the stream, checkpoints, and builds the summary."""

    def __init__(self, prepared: fx.GraphModule, options: _Options, observers: dict[str, Observer]) -> None:
        self.prepared, self.options, self.observers = prepared, options, observers
        self.params, _ = forward_parameters(prepared)
        state = getattr(prepared, "meta", {}).get(STATE_KEY)
        self.progress = Progress(base_samples=state.calibration_samples if state is not None else 0)
        self.resumed_batches = 0
        self.spreads: list[ChannelSpread] | None = None if options.diagnose else []

    def restore(self) -> None:
        """Continue from the checkpoint when asked to and one exists; otherwise start from the first batch."""
        path = self.options.checkpoint
        if path is None or not self.options.resume or not path.exists():
            if path is not None and path.exists():
                log.warning("overwriting calibration checkpoint %s (pass resume=True to continue from it)", path)
            return
        self.progress = load_checkpoint(path, self.observers)
        self.resumed_batches = self.progress.batches
        log.info("resuming calibration from %s after %d batches", path, self.progress.batches)

    def _selected(self, raw: Iterator[Any]) -> Iterator[tuple[int, Any]]:
        """``(stream index, batch)`` for this rank, from the checkpoint's position up to ``num_batches``."""
        items = itertools.islice(enumerate(raw), self.progress.position, self.options.num_batches)
        opts = self.options
        return (item for item in items if not opts.shard or item[0] % opts.world == opts.rank)

    def _step(self, index: int, batch: Any) -> int:
        """Feed one batch; NaN/Inf batches raise or are counted as skipped. Returns the batch's tokens (0 when it
        is not token ids)."""
        if self.options.transform is not None:
            batch = self.options.transform(batch)
        args, kwargs = to_call_args(batch, self.params)
        if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in (*args, *kwargs.values())):
            raise InputError(f"calibration batch {index} is empty (a tensor with 0 elements); drop empty batches "
                             "from the data")
        if not _finite(args, kwargs):
            if not self.options.skip_nonfinite:
                raise CalibrationError(f"calibration batch {index} contains NaN or Inf values; clean the data or "
                                       "pass skip_nonfinite=True to skip such batches")
            self.progress.skipped.append(index)
            return 0
        _run_batch(self.prepared, index, args, kwargs)
        if self.spreads is None:
            self.spreads = channel_spreads(self.prepared, self.observers, args, kwargs)
        self.progress.batches += 1
        self.progress.samples += batch_size_of(args, kwargs)
        return _tokens(args, kwargs)

    def consume(self, raw: Iterator[Any], total: int | None) -> None:
        opts, progress, start = self.options, self.progress, time.perf_counter()
        if total is not None and opts.shard:
            total = math.ceil(max(total - progress.position, 0) / opts.world)
        elif total is not None:
            total -= progress.position
        bar = tqdm(total=total, desc="calibrating", unit="batch", file=sys.stderr,
                   disable=not opts.progress or opts.rank != 0, leave=False)
        by_tokens = False
        with bar:
            for done, (index, batch) in enumerate(self._selected(raw), start=1):
                tokens = self._step(index, batch)
                if tokens and done == 1 and not bar.disable:  # token ids (a language model): count tokens
                    by_tokens, bar.unit, bar.unit_scale = True, "tok", True
                    bar.total = None if total is None else total * tokens
                bar.update(tokens if by_tokens else 1)
                progress.position = index + 1
                if not by_tokens:  # tokens: the bar's own rate is tokens per second
                    bar.set_postfix(samples_per_s=f"{progress.samples / (time.perf_counter() - start):.0f}")
                if opts.checkpoint is not None and done % opts.checkpoint_every == 0:
                    save_checkpoint(opts.checkpoint, self.observers, progress)
                if opts.max_samples is not None and progress.samples >= opts.max_samples:
                    break
        if opts.checkpoint is not None:
            save_checkpoint(opts.checkpoint, self.observers, progress)

    def summary(self, progress: Progress, seconds: float) -> CalibrationSummary:
        if progress.batches == 0:
            raise CalibrationError("calibration data yielded no usable batch; pass a non-empty dataset")
        if getattr(self.prepared, "meta", {}).get(STATE_KEY) is not None:
            update_state(self.prepared, calibration_samples=progress.base_samples + progress.samples)
        summary = CalibrationSummary(progress.batches, progress.samples, seconds, list(progress.skipped),
                                     channel_spreads=self.spreads or [], resumed_batches=self.resumed_batches)
        summary.record_observers(self.observers)
        for text in summary.warnings:
            log.warning("calibration: %s", text)
        for spread in summary.channel_spreads:
            log.info("calibration: channel ranges differ by orders of magnitude at %s", spread)
        return summary


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The number of token ids a batch holds: its ``input_ids`` (or first input) when that is a 2-d integer
    tensor, else 0."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
        return 0
    return ids.numel()


def _resolve(distributed: bool, data: object, options: dict[str, Any]) -> _Options:
    """Validate the options and fix this rank's share of the work."""
    for name in ("num_batches", "max_samples", "checkpoint_every"):
        value = options[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"calibrate(): {name} must be a positive integer or None, got {value!r}")
    checkpoint = options["checkpoint"]
    options["checkpoint"] = Path(checkpoint) if checkpoint is not None else None
    if not distributed:
        return _Options(**options)
    rank, world = rank_and_world()
    if options["max_samples"] is not None:
        options["max_samples"] = math.ceil(options["max_samples"] / world)
    if options["checkpoint"] is not None and world > 1:
        options["checkpoint"] = options["checkpoint"].with_name(f"{options['checkpoint'].name}.rank{rank}")
    presharded = type(getattr(data, "sampler", None)).__name__ == "DistributedSampler"
    return _Options(**options, rank=rank, world=world, shard=world > 1 and not presharded)


def calibrate(prepared: fx.GraphModule, data: Iterable[Any] | torch.Tensor, *, num_batches: int | None = None,
              max_samples: int | None = None, progress: bool = True, skip_nonfinite: bool = False,
              batch_size: int = 32, transform: Transform | None = None, diagnose: bool = True,
              checkpoint: str | os.PathLike[str] | None = None, checkpoint_every: int = 10, resume: bool = False,
              distributed: bool = False) -> CalibrationSummary:
    """Run ``data`` through ``prepared`` under ``torch.inference_mode()`` so its observers record ranges.

    ``data`` yields batches (see :mod:`fxquant.calibration.adapters`; ``transform`` is applied to each batch first);
    at most ``num_batches`` batches or ``max_samples`` samples are used. A batch containing NaN/Inf raises
    ``CalibrationError`` naming it, unless ``skip_nonfinite=True``, which skips it and lists it in the summary.
    ``diagnose`` adds per-channel range hints from the first batch (:mod:`fxquant.calibration.diagnostics`).
    ``checkpoint`` saves the statistics every ``checkpoint_every`` batches and at the end; ``resume=True`` continues
    from it (:mod:`fxquant.calibration.checkpoint`). ``distributed=True`` calibrates this rank's shard and merges
    the observers across ranks (:mod:`fxquant.calibration.distributed`). Example::

        summary = fxquant.calibrate(prepared, loader, num_batches=32)
        print(summary)
    """
    state = getattr(prepared, "meta", {}).get(STATE_KEY)
    if state is not None and state.stage == "converted":
        raise InputError("calibrate() takes the model returned by prepare(); this one is already converted (its "
                         "observers are gone): calibrate the prepared model, then convert it again")
    options = _resolve(distributed, data, {
        "num_batches": num_batches, "max_samples": max_samples, "progress": progress,
        "skip_nonfinite": skip_nonfinite, "transform": transform, "diagnose": diagnose, "checkpoint": checkpoint,
        "checkpoint_every": checkpoint_every, "resume": resume})
    start = time.perf_counter()
    with observing(prepared) as observers:
        run = _Run(prepared, options, observers)
        run.restore()
        length = count_batches(data, batch_size)
        run.consume(iterate_batches(data, batch_size=batch_size), _at_most(length, num_batches))
    result = run.progress
    if distributed:
        merge_across_ranks(prepared)
        result = gather_progress(result)
    return run.summary(result, time.perf_counter() - start)


def _at_most(length: int | None, limit: int | None) -> int | None:
    return limit if length is None else min(length, limit or length)

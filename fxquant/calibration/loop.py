"""The calibration loop: run real batches through a prepared model so its observers record ranges."""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from tqdm import tqdm

from fxquant.calibration.adapters import batch_size_of, forward_parameters, iterate_batches, to_call_args
from fxquant.calibration.observing import observing
from fxquant.errors import CalibrationError, FxQuantError, InputError
from fxquant.state import STATE_KEY, update_state

log = logging.getLogger(__name__)


@dataclass
class CalibrationSummary:
    """What a calibration run saw: batches, samples, and the range each observer recorded."""

    batches: int
    samples: int
    seconds: float
    skipped_batches: list[int] = field(default_factory=list)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    unobserved: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"calibrated on {self.samples} samples in {self.batches} batches ({self.seconds:.2f} s)"]
        if self.skipped_batches:
            lines.append(f"skipped {len(self.skipped_batches)} batches with NaN/Inf: {self.skipped_batches}")
        lines += [f"  {label}: [{lo:.4g}, {hi:.4g}]" for label, (lo, hi) in self.ranges.items()]
        lines += [f"  {label}: saw no data" for label in self.unobserved]
        return "\n".join(lines)


def _finite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    values = (*args, *kwargs.values())
    return all(bool(torch.isfinite(v).all()) for v in values if isinstance(v, torch.Tensor) and v.is_floating_point())


def _length(data: object) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


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


def calibrate(prepared: fx.GraphModule, data: Iterable[Any] | torch.Tensor, *, num_batches: int | None = None,
              max_samples: int | None = None, progress: bool = True, skip_nonfinite: bool = False,
              batch_size: int = 32) -> CalibrationSummary:
    """Run ``data`` through ``prepared`` under ``torch.inference_mode()`` so its observers record ranges.

    ``data`` yields batches (see :mod:`fxquant.calibration.adapters`); at most ``num_batches`` batches or
    ``max_samples`` samples are used. A batch containing NaN/Inf raises ``CalibrationError`` naming it, unless
    ``skip_nonfinite=True``, which skips it and lists it in the summary. Example::

        summary = fxquant.calibrate(prepared, loader, num_batches=32)
        print(summary)
    """
    params, _ = forward_parameters(prepared)
    summary = CalibrationSummary(batches=0, samples=0, seconds=0.0)
    start = time.perf_counter()
    batches = itertools.islice(iterate_batches(data, batch_size=batch_size), num_batches)
    total = num_batches if num_batches is not None else _length(data)
    with observing(prepared) as observers, tqdm(batches, total=total, desc="calibrating", unit="batch",
                                                file=sys.stderr, disable=not progress, leave=False) as bar:
        for index, batch in enumerate(bar):
            args, kwargs = to_call_args(batch, params)
            if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in (*args, *kwargs.values())):
                raise InputError(f"calibration batch {index} is empty (a tensor with 0 elements); drop empty "
                                 "batches from the data")
            if not _finite(args, kwargs):
                if not skip_nonfinite:
                    raise CalibrationError(f"calibration batch {index} contains NaN or Inf values; clean the data "
                                           "or pass skip_nonfinite=True to skip such batches")
                summary.skipped_batches.append(index)
                continue
            _run_batch(prepared, index, args, kwargs)
            summary.batches += 1
            summary.samples += batch_size_of(args, kwargs)
            bar.set_postfix(samples_per_s=f"{summary.samples / (time.perf_counter() - start):.0f}")
            if max_samples is not None and summary.samples >= max_samples:
                break
    summary.seconds = time.perf_counter() - start
    state = getattr(prepared, "meta", {}).get(STATE_KEY)
    if state is not None:
        update_state(prepared, calibration_samples=state.calibration_samples + summary.samples)
    if summary.batches == 0:
        raise CalibrationError("calibration data yielded no usable batch; pass a non-empty dataset")
    for obs in observers.values():
        if obs.has_data:
            summary.ranges[obs.label] = (float(obs.min_val), float(obs.max_val))
        else:
            summary.unobserved.append(obs.label)
    return summary

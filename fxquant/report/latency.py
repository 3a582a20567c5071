"""Side-by-side latency: models measured interleaved in one run, so their ratio survives a noisy machine."""

from __future__ import annotations

import contextlib
import functools
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds per call."""

    median: float
    p90: float
    min: float
    max: float
    runs: int

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "p90": self.p90, "min": self.min, "max": self.max, "runs": self.runs}

    @classmethod
    def from_numbers(cls, median: float, p90: float, extra: Mapping[str, float | int] | None = None) -> LatencyStats:
        """Stats read back from a report: reports written by hand or by older tools may hold only median and p90."""
        extra = extra or {}
        return cls(float(median), float(p90), float(extra.get("min", median)), float(extra.get("max", p90)),
                   int(extra.get("runs", 0)))


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Fix torch's intra-op thread count for the block (None keeps the current setting)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _stats(samples: Sequence[float]) -> LatencyStats:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return LatencyStats(statistics.median(ordered), p90, ordered[0], ordered[-1], len(ordered))


def _converged(samples: Sequence[float], rel_ci: float) -> bool:
    """Whether the 95% confidence half-width of the mean is below ``rel_ci`` of the median."""
    if len(samples) < 5:
        return False
    half_width = 1.96 * statistics.stdev(samples) / len(samples) ** 0.5
    return half_width <= rel_ci * statistics.median(samples)


def measure_latency(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 3, min_runs: int = 5, max_runs: int = 200,
                    time_budget_s: float = 10.0, rel_ci: float = 0.02,
                    threads: int | None = None) -> dict[str, LatencyStats]:
    """Time each zero-argument callable in ``fns``, interleaved round by round, under ``torch.inference_mode``.

    Always runs ``min_runs`` rounds; then stops when every callable's mean is known within ``rel_ci`` (95%
    confidence), after ``max_runs`` rounds, or when ``time_budget_s`` is spent, whichever is first. The rounds are
    :func:`interleaved_samples`'.
    """
    with num_threads(threads):
        samples = interleaved_samples(fns, warmup=warmup, min_runs=min_runs, max_runs=max_runs,
                                      time_budget_s=time_budget_s, rel_ci=rel_ci)
    return {name: _stats(s) for name, s in samples.items()}


def interleaved_samples(fns: Mapping[str, Callable[[], Any]], *, warmup: int, min_runs: int, max_runs: int,
                        time_budget_s: float, rel_ci: float | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Milliseconds of every call of each callable, one call each per round, under ``torch.inference_mode``.

    Each round runs the callables in a new order (a seeded shuffle, so a run is repeatable): whatever runs right
    after another model pays for what that model left behind (its weights in the caches; after a float model, int8
    kernels run slower for a while), and a fixed order - or one merely rotated, which keeps every callable's
    predecessor - would charge it to the same callable every round (docs/benchmarks.md, "Method", has the
    measured cost). The i-th samples of two callables come from the same round, so their ratio is paired.
    Stops after ``min_runs`` rounds once every mean is known within ``rel_ci`` (None: never), the time budget is
    spent, or after ``max_runs``. ``clock``: e.g. ``time.process_time`` to leave out the time other processes hold
    a core.
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    with torch.inference_mode():
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        deadline = time.perf_counter() + time_budget_s
        for round_ in range(max_runs):
            shuffle(order)
            for name, fn in order:
                start = clock()
                fn()
                samples[name].append((clock() - start) * 1e3)
            if round_ + 1 < min_runs:
                continue
            converged = rel_ci is not None and all(_converged(s, rel_ci) for s in samples.values())
            if converged or time.perf_counter() > deadline:
                break
    return samples


def resize_batch(args: tuple[Any, ...], kwargs: Mapping[str, Any], batch_size: int) -> tuple[tuple[Any, ...],
                                                                                              dict[str, Any]]:
    """The inputs of one batch cut or tiled along dim 0 to ``batch_size`` rows, so any batch size can be timed."""
    def resize(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        repeats = -(-batch_size // value.shape[0])
        return value.repeat(repeats, *[1] * (value.dim() - 1))[:batch_size]

    return tuple(resize(v) for v in args), {k: resize(v) for k, v in kwargs.items()}


def measure_batch_sizes(models: Mapping[str, Callable[..., Any]], inputs: tuple[tuple[Any, ...], Mapping[str, Any]],
                        batch_sizes: Sequence[int], *, time_budget_s: float = 10.0,
                        threads: int | None = None) -> list[tuple[int, dict[str, LatencyStats]]]:
    """``measure_latency`` of every model at every batch size, the models interleaved at each size.

    ``inputs`` is one batch as ``(args, kwargs)``; it is resized per batch size with :func:`resize_batch`. The time
    budget is shared equally between batch sizes.
    """
    results = []
    for batch_size in batch_sizes:
        args, kwargs = resize_batch(inputs[0], inputs[1], batch_size)
        fns = {name: functools.partial(model, *args, **kwargs) for name, model in models.items()}
        stats = measure_latency(fns, time_budget_s=time_budget_s / len(batch_sizes), threads=threads)
        results.append((batch_size, stats))
    return results

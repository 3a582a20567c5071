"""What a converted model's call costs around its kernels at batch 1: the whole call against its kernels alone.

For each model (onednn backend, one replayed run from its input to its output: fxquant.runtime.replay) it times,
interleaved in random order round by round, the model's call (``qmodel(x)``, as a user calls it) and the same
recorded C calls (quantize, primitives, pools) on fixed buffers with no Python around them, each either right after
an untimed call of its own ("hot") or after writing a buffer four times the core's L2 ("cold"). Cold is what a model
called between other work sees, and what ``scripts/benchmark.py`` measures: its candidates run in turn, each evicting
the others' weights and code. The difference, paired per round, is the Python, dispatch and allocation a call costs
around its kernels; with cold caches every frame and torch call on that path pays misses (docs/backends.md, "The
graph walk").

    python scripts/bench_call_overhead.py [--models mlp resnet18 mobilenetv2] [--rounds 300]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fxquant
from fxquant.models import create_model, example_inputs
from fxquant.native.isa import cpu_model, isa_summary
from fxquant.runtime import replay

Timed = Callable[[], Any]


def l2_bytes() -> int:
    """This core's L2 size from sysfs (2 MB when it is not there)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
    except OSError:
        return 2 << 20
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * scale


def converted(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    x = example_inputs(name, 1)[0]
    prepared = fxquant.prepare(create_model(name), (x,))
    fxquant.calibrate(prepared, [example_inputs(name, 4, seed=s) for s in range(1, 5)], progress=False)
    qmodel = fxquant.convert(prepared, backend="onednn")
    with torch.inference_mode():
        for _ in range(3):
            qmodel(x)
    return qmodel, x


def kernels_alone(qmodel: torch.nn.Module, x: torch.Tensor) -> tuple[Timed, list[Any]] | None:
    """The model's recorded calls on fixed buffers (and what keeps those alive), or None where its walk is not one
    replayed run."""
    steps = qmodel.forward.plan.steps
    if len(steps) != 1 or not isinstance(steps[0].target, replay.Run):
        return None
    run = steps[0].target
    recording = next((r for r in run.recordings.values() if r is not None), None)
    if recording is None or len(recording.inputs) != 1:
        return None
    block, pointers = replay._block(recording)
    keep: list[Any] = [block, x]
    pointers[0] = x.data_ptr()  # buffer 0: the run's one input
    for buffer, shape, stride, dtype in recording.fresh:
        keep.append(torch.empty_strided(shape, stride, dtype=dtype))
        pointers[buffer] = keep[-1].data_ptr()
    calls = [(call, pointers[source], pointers[destination]) for call, source, destination in recording.calls]

    def kernels() -> None:
        for call, source, destination in calls:
            call(source, destination)

    return kernels, keep


def timed(candidates: dict[str, Timed], rounds: int, flush: torch.Tensor) -> dict[str, list[float]]:
    """Microseconds of each call, one per candidate per round in a new random order: "cold" ones after ``flush``,
    the others after an untimed call of their own."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates.items())
    shuffle = random.Random(0).shuffle
    with torch.inference_mode():
        for _ in range(rounds):
            shuffle(order)
            for name, fn in order:
                if name.endswith("cold"):
                    flush.add_(1)
                else:
                    fn()  # hot: right after a call of its own
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) * 1e6)
    return samples


def _us(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet18", "mobilenetv2"])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    flush = torch.zeros(4 * l2_bytes(), dtype=torch.uint8)
    print(f"CPU: {cpu_model()} ({isa_summary()}), L2 {l2_bytes() >> 10} KB, one thread, batch 1, onednn; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("\n| model | state | call us | kernels alone us | around the kernels us (paired median) |")
    print("|---|---|---:|---:|---:|")
    for name in args.models:
        qmodel, x = converted(name)
        alone = kernels_alone(qmodel, x)
        candidates: dict[str, Timed] = {}
        for state in ("hot", "cold"):
            candidates[f"call {state}"] = functools.partial(qmodel, x)
            if alone is not None:
                candidates[f"kernels {state}"] = alone[0]
        samples = timed(candidates, args.rounds, flush)
        for state in ("hot", "cold"):
            call = samples[f"call {state}"]
            kernels = samples.get(f"kernels {state}")
            around = "n/a" if kernels is None else \
                f"{statistics.median(c - k for c, k in zip(call, kernels, strict=True)):.1f}"
            print(f"| {name} | {state} | {_us(call)} | {'n/a' if kernels is None else _us(kernels)} | {around} |")


if __name__ == "__main__":
    main()

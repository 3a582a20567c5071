"""Calibration benchmark: speed and peak memory of every observer against torch.ao's, and accuracy per observer.

Speed: on the ResNet-18-style network (batch 32, 224x224) and the BERT-style encoder (batch 8, 128 tokens), the
float forward and the calibration forward (a prepared model whose observers record every batch) with each fxquant
observer and with torch.ao's MinMaxObserver and HistogramObserver (``prepare_fx`` with those activation observers
and per-channel weight observers), all timed interleaved on the same cycling batches
(:func:`fxquant.report.latency.measure_latency`), as ratios over the float forward. ``fxquant[off]`` is the prepared
graph with its observers disabled, ``torch.ao[off]`` torch.ao's with its observers replaced by identities: the
difference to them is what the observers themselves cost. fxquant's configurations run inside ``fxquant.observing``,
as ``fxquant.calibrate`` runs them (Conv2d weights channels-last where prepare() found the model runs so);
``float[channels_last]`` (conv models only) is the user's float model with channels-last weights, printed so the
reader sees what the memory layout alone is worth. ``--models`` and ``--skip-accuracy`` shorten a run.

Memory: each configuration runs in its own subprocess, which reports its peak RSS, and the peak RSS of the
calibration forwards alone above the RSS before them (``VmHWM`` reset through ``/proc/self/clear_refs`` after a warm-up
forward with observers off: activations plus the observers' temporaries), plus the bytes of observer state (buffers).

Threads: ``--threads`` (default 1). On a shared machine whose load exceeds its cores, every multi-threaded op waits
for a preempted thread at its barrier, so a 2-thread timing measures the scheduler more than the code.

Accuracy: INT8 top-1 and logit SQNR per observer on the digits CNN, and on the same CNN with planted activation
outliers (two channels of ``bn1`` made 100x larger, ``conv2`` reading them 100x smaller: the float function is
unchanged, per-tensor ranges are not), and whether ``percentile``/``entropy``/``mse`` beat ``minmax`` on the latter.

Targets: every fxquant observer <= 1.3x the float forward; the histogram family >= 1.5x faster than torch.ao's
HistogramObserver. Run: ``python scripts/bench_calibration.py [--quick]`` (the default run takes several minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _bench_common import _quiet_torch_deprecations, environment_lines, sqnr_db
from torch import nn

import fxquant
from fxquant.calibration import observers_of
from fxquant.kernels.quantized_engine import quantized_engine
from fxquant.models import create_model, example_inputs
from fxquant.models.digits import DigitsCNN, accuracy, digits_loader, train_digits_cnn
from fxquant.report.latency import LatencyStats, measure_latency

OBSERVERS = ("minmax", "moving_average", "histogram", "percentile", "entropy", "mse")
HISTOGRAM_FAMILY = ("histogram", "percentile", "entropy", "mse")
PEERS = ("minmax", "histogram")
SPEED_TARGET, PEER_TARGET = 1.3, 1.5
WORKLOADS = {"resnet18": 32, "bert_style": 8}
QUICK_WORKLOADS = {"resnet18": 4, "bert_style": 2}


def labels() -> list[str]:
    return ["float", "fxquant[off]", *(f"fxquant[{n}]" for n in OBSERVERS), "torch.ao[off]",
            *(f"torch.ao[{n}]" for n in PEERS)]


def _torch_ao_observer(name: str) -> Any:
    """torch.ao's observer class, skipping integer tensors (token ids), which its HistogramObserver cannot bin."""
    from torch.ao.quantization import HistogramObserver, MinMaxObserver

    base = {"minmax": MinMaxObserver, "histogram": HistogramObserver}[name]

    class FloatOnly(base):  # type: ignore[misc, valid-type]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) if x.is_floating_point() else x

    return FloatOnly.with_args(reduce_range=False)


def torch_ao_prepared(model: nn.Module, example: tuple[Any, ...], name: str) -> nn.Module:
    from torch.ao.quantization import QConfig, QConfigMapping, default_per_channel_weight_observer
    from torch.ao.quantization.quantize_fx import prepare_fx

    qconfig = QConfig(activation=_torch_ao_observer(name), weight=default_per_channel_weight_observer)
    mapping = QConfigMapping().set_global(qconfig).set_object_type(nn.Embedding, None)
    with _quiet_torch_deprecations():
        return prepare_fx(copy.deepcopy(model), mapping, example)


def build(label: str, model: nn.Module, example: tuple[Any, ...]) -> nn.Module:
    """The module a configuration runs: the float model, an fxquant prepared model, or a torch.ao one."""
    if label == "float":
        return model
    if label == "float[channels_last]":  # what the memory layout alone is worth (fxquant calibrates convs so)
        return copy.deepcopy(model).to(memory_format=torch.channels_last)
    family, name = label.rstrip("]").split("[")
    if family == "torch.ao":
        return torch_ao_prepared(model, example, name) if name != "off" else _without_observers(
            torch_ao_prepared(model, example, "minmax"))
    return fxquant.prepare(model, example, fxquant.QuantConfig(activation="minmax" if name == "off" else name))


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


def cycling(module: nn.Module, batches: list[tuple[Any, ...]]) -> Callable[[], Any]:
    stream = itertools.cycle(batches)
    return lambda: module(*next(stream))


def time_workload(name: str, batch_size: int, args: argparse.Namespace) -> dict[str, LatencyStats]:
    model = create_model(name)
    batches = [example_inputs(name, batch_size, seed=seed) for seed in range(1, 5)]
    extra = ["float[channels_last]"] if any(isinstance(m, nn.Conv2d) for m in model.modules()) else []
    modules = {label: build(label, model, batches[0]) for label in [*labels(), *extra]}
    with contextlib.ExitStack() as stack, _quiet_torch_deprecations():
        for label, module in modules.items():
            stack.enter_context(calibrating(label, module))
        fns = {label: cycling(module, batches) for label, module in modules.items()}
        return measure_latency(fns, warmup=1, min_runs=3 if args.quick else 5, max_runs=40,
                               time_budget_s=20 if args.quick else 60, threads=args.threads)


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
    batches = [example_inputs(name, batch_size, seed=seed) for seed in range(1, 3)]
    module = build(label, create_model(name), batches[0])
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


def speed_table(name: str, batch_size: int, stats: dict[str, LatencyStats], memory: dict[str, dict[str, float]]
                ) -> list[str]:
    base = stats["float"].median
    lines = [f"\n## {name}, batch {batch_size}: calibration forward vs float forward",
             "| configuration | median ms | p90 ms | x float | peak RSS MB | forward peak MB | observer state KB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, s in stats.items():
        m = memory[label]
        lines.append(f"| {label} | {s.median:.1f} | {s.p90:.1f} | {s.median / base:.2f} | {m['peak_mb']:.0f} | "
                     f"{m['growth_mb']:.1f} | {m['state_kb']:.1f} |")
    return lines


def target_lines(name: str, stats: dict[str, LatencyStats]) -> list[str]:
    """The two targets, with the torch.ao comparison computed three ways (see ``RATIOS``)."""
    base = stats["float"].median
    lines = []
    for observer in OBSERVERS:
        ratio = stats[f"fxquant[{observer}]"].median / base
        lines.append(f"- {name} fxquant[{observer}]: {ratio:.2f}x float "
                     f"({'meets' if ratio <= SPEED_TARGET else 'MISSES'} <= {SPEED_TARGET}x)")
    peer = stats["torch.ao[histogram]"].median
    for observer in HISTOGRAM_FAMILY:
        ours = stats[f"fxquant[{observer}]"].median
        speedup = peer / ours
        overhead = (ours - base) / max(peer - base, 1e-9)
        own = ours - stats["fxquant[off]"].median
        alone = (peer - stats["torch.ao[off]"].median) / own if own > 0 else float("inf")
        lines.append(f"- {name} fxquant[{observer}] vs torch.ao HistogramObserver: end-to-end {speedup:.2f}x faster "
                     f"({'meets' if speedup >= PEER_TARGET else 'MISSES'} >= {PEER_TARGET}x); overhead over float "
                     + (f"{overhead:.2f} of torch.ao's" if overhead > 0 else "none (faster than the float forward)")
                     + f"; observers alone {alone:.2f}x smaller")
    return lines


RATIOS = """How the torch.ao HistogramObserver comparison is computed (medians of the interleaved runs above):
- end-to-end (the target): torch.ao[histogram] / fxquant[method], both full calibration forwards;
- overhead over float: (fxquant[method] - float) / (torch.ao[histogram] - float), what calibrating costs beyond the
  eager float forward (below 1: fxquant's costs less);
- observers alone: (torch.ao[histogram] - torch.ao[off]) / (fxquant[method] - fxquant[off]), each graph minus
  itself with observers off (fxquant's graph folds BatchNorm, so its float part is smaller than eager's)."""


def planted_outliers(model: DigitsCNN, channels: tuple[int, ...] = (3, 11), factor: float = 100.0) -> DigitsCNN:
    """The same function with ``bn1`` channels ``channels`` ``factor`` times larger (ReLU commutes with scaling)."""
    planted = copy.deepcopy(model)
    with torch.no_grad():
        for channel in channels:
            planted.bn1.weight[channel] *= factor
            planted.bn1.bias[channel] *= factor
            planted.conv2.weight[:, channel] /= factor
    return planted


def accuracy_rows(model: nn.Module) -> list[tuple[str, float, float]]:
    """``(configuration, INT8 top-1, logit SQNR dB)`` for every fxquant observer and the torch.ao peers."""
    calib, test = digits_loader("calib"), digits_loader("test", batch_size=512)
    images = next(iter(test))[0]
    with torch.no_grad():
        reference = model(images)
    rows = [("float", accuracy(model, test), float("inf"))]
    for name in OBSERVERS:
        prepared = fxquant.prepare(model, (images[:1],), fxquant.QuantConfig(activation=name))
        fxquant.calibrate(prepared, calib, progress=False, diagnose=False)
        qmodel = fxquant.convert(prepared)
        with torch.no_grad():
            rows.append((f"fxquant[{name}]", accuracy(qmodel, test), sqnr_db(reference, qmodel(images))))
    for name in PEERS:
        rows.append((f"torch.ao[{name}]", *_torch_ao_accuracy(model, name, calib, test, reference)))
    return rows


def _torch_ao_accuracy(model: nn.Module, name: str, calib: Any, test: Any, reference: torch.Tensor
                       ) -> tuple[float, float]:
    from torch.ao.quantization.quantize_fx import convert_fx

    images = next(iter(test))[0]
    with quantized_engine("fbgemm"), _quiet_torch_deprecations(), torch.no_grad():
        prepared = torch_ao_prepared(model, (images[:1],), name)
        for batch, _ in calib:
            prepared(batch)
        qmodel = convert_fx(prepared)
        return accuracy(qmodel, test), sqnr_db(reference, qmodel(images))


CLIPPING = ("percentile", "entropy", "mse")  # the target: each beats minmax on the outlier model


def accuracy_section() -> list[str]:
    model = train_digits_cnn()
    lines = []
    for title, candidate in (("digits CNN", model), ("digits CNN with planted outliers", planted_outliers(model))):
        rows = accuracy_rows(candidate)
        lines += [f"\n## INT8 accuracy: {title} (test split; calibration on the calib split)",
                  "| configuration | top-1 | logit SQNR dB |", "|---|---:|---:|"]
        lines += [f"| {label} | {top1:.2%} | {sqnr:.1f} |" for label, top1, sqnr in rows]
    sqnr = {label: value for label, _, value in rows}
    baseline = sqnr["fxquant[minmax]"]
    lines.append("\nTarget (outlier model): " + "; ".join(
        f"{name} {sqnr[f'fxquant[{name}]']:.1f} dB {'beats' if sqnr[f'fxquant[{name}]'] > baseline else 'MISSES'} "
        f"minmax {baseline:.1f} dB" for name in CLIPPING if f"fxquant[{name}]" in sqnr))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small batches and short timing budgets")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while timing (default 1)")
    parser.add_argument("--skip-memory", action="store_true", help="no per-configuration memory subprocesses")
    parser.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS),
                        help="models to time (default: all)")
    parser.add_argument("--skip-accuracy", action="store_true", help="no per-observer accuracy section")
    parser.add_argument("--probe", nargs=3, metavar=("MODEL", "LABEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe_memory(args.probe[0], args.probe[1], int(args.probe[2]))))
        return
    print("# fxquant calibration benchmark\n" + "\n".join(f"- {line}" for line in environment_lines()))
    print(f"- timing threads: {args.threads}; forward peak MB = peak RSS of the timed forwards above the RSS before")
    targets: list[str] = []
    for name, batch_size in (QUICK_WORKLOADS if args.quick else WORKLOADS).items():
        if name not in args.models:
            continue
        stats = time_workload(name, batch_size, args)
        nan = {"peak_mb": float("nan"), "growth_mb": float("nan"), "state_kb": float("nan")}
        memory = {label: nan if args.skip_memory else memory_of(name, label, batch_size) for label in stats}
        print("\n".join(speed_table(name, batch_size, stats, memory)), flush=True)
        targets += target_lines(name, stats)
    print("\n## Targets\n" + "\n".join(targets) + "\n\n" + RATIOS)
    print("".join(f"- at the end of the timing: {line}" for line in environment_lines() if line.startswith("load")))
    if not args.skip_accuracy:
        print("\n".join(accuracy_section()))


if __name__ == "__main__":
    main()

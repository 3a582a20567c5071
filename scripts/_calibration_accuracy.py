"""bench_calibration.py's torch.ao peers (``prepare_fx`` with its MinMax/Histogram observers) and its INT8 accuracy
section: top-1 and logit SQNR per observer on the digits CNN, with and without planted activation outliers."""

from __future__ import annotations

import copy
from typing import Any

import torch
from _bench_common import _quiet_torch_deprecations, sqnr_db
from eval_observers import planted_outliers
from torch import nn

import fxquant
from fxquant.kernels.torch_engines.engine import quantized_engine
from fxquant.models.digits import accuracy, digits_loader, train_digits_cnn

OBSERVERS = ("minmax", "moving_average", "histogram", "percentile", "entropy", "mse")
PEERS = ("minmax", "histogram")
BACKEND = "onednn"  # the default backend; prepare() builds the same calibration graph for the others


def _torch_ao_observer(name: str) -> Any:
    """torch.ao's observer class, skipping integer tensors (token ids), which its HistogramObserver cannot bin."""
    from torch.ao.quantization import HistogramObserver, MinMaxObserver

    base = {"minmax": MinMaxObserver, "histogram": HistogramObserver}[name]

    class FloatOnly(base):  # type: ignore[misc, valid-type]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) if x.is_floating_point() else x

    return FloatOnly.with_args(reduce_range=False)


def torch_ao_prepared(model: nn.Module, example: tuple[Any, ...], name: str) -> torch.fx.GraphModule:
    from torch.ao.quantization import QConfig, QConfigMapping, default_per_channel_weight_observer
    from torch.ao.quantization.quantize_fx import prepare_fx

    qconfig = QConfig(activation=_torch_ao_observer(name), weight=default_per_channel_weight_observer)
    mapping = QConfigMapping().set_global(qconfig).set_object_type(nn.Embedding, None)
    with _quiet_torch_deprecations():
        return prepare_fx(copy.deepcopy(model), mapping, example)


def accuracy_rows(model: nn.Module) -> list[tuple[str, float, float]]:
    """``(configuration, INT8 top-1, logit SQNR dB)`` for every fxquant observer and the torch.ao peers."""
    calib, test = digits_loader("calib"), digits_loader("test", batch_size=512)
    images = next(iter(test))[0]
    with torch.no_grad():
        reference = model(images)
    rows = [("float", accuracy(model, test), float("inf"))]
    for name in OBSERVERS:
        prepared = fxquant.prepare(model, (images[:1],), fxquant.QuantConfig(backend=BACKEND, activation=name))
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


CLIPPING = ("percentile", "entropy", "mse")  # the clipping target: each beats minmax on the outlier model


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

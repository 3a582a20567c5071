"""Calibration forwards with Conv2d weights in channels-last memory.

oneDNN's float convolution runs faster on channels-last (NHWC) tensors than on the default NCHW layout, which it
reorders on every call (docs/calibration.md, "Benchmark", times both layouts). A convolution with a channels-last
weight produces a channels-last output from either input layout, and element-wise ops, pooling and the observers
(which read memory in any dense order) keep it, so converting the Conv2d weights is enough to move a whole conv
trunk to NHWC. Values are the same up to float summation order.

It is scoped to calibration (:func:`~fxquant.calibration.observing.observing` and ``fxquant.calibrate``): outside,
the prepared model keeps the user's layouts, and its outputs keep theirs. A model whose code only works on NCHW
memory (``x.view(n, -1)`` after a convolution raises on NHWC) is detected at prepare time by one trial run of the
example inputs, and calibrates in NCHW.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fxquant.observers import Observer

log = logging.getLogger("fxquant")


def _conv2d_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]


@contextlib.contextmanager
def channels_last_convs(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the block with ``model``'s Conv2d weights channels-last; the original tensors are put back on exit."""
    weights = _conv2d_weights(model) if enabled else []
    originals = [w.data for w in weights]
    try:
        with torch.inference_mode(False):  # an inference-mode copy could not become a parameter's data
            for weight in weights:
                weight.data = weight.data.contiguous(memory_format=torch.channels_last)
        yield
    finally:
        for weight, original in zip(weights, originals, strict=True):
            weight.data = original


def runs_channels_last(prepared: nn.Module, example_inputs: tuple[Any, ...]) -> bool:
    """Whether ``prepared`` has Conv2d layers and runs the example inputs with them channels-last (observers off)."""
    if not _conv2d_weights(prepared):
        return False
    observers = [m for m in prepared.modules() if isinstance(m, Observer)]
    previous = [obs.enabled for obs in observers]
    try:
        for obs in observers:
            obs.enabled = False
        with channels_last_convs(prepared), torch.no_grad():
            prepared(*example_inputs)
    except Exception as exc:  # any failure: the model's own code needs NCHW memory somewhere
        log.info("fxquant: calibrating %s in NCHW memory; with channels-last Conv2d weights it fails: %s",
                 type(prepared).__name__, (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        return False
    finally:
        for obs, enabled in zip(observers, previous, strict=True):
            obs.enabled = enabled
    return True

"""``observing(prepared)``: let users drive their own calibration loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fxquant.observers import Observer


def observers_of(model: nn.Module) -> dict[str, Observer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Observer)}


@contextlib.contextmanager
def observing(prepared: nn.Module) -> Iterator[dict[str, Observer]]:
    """Enable every observer of ``prepared`` and run the block under ``torch.inference_mode()``.

    Example::

        with fxquant.observing(prepared):
            for x, _ in loader:
                prepared(x)

    Observers are restored to their previous enabled state on exit, even when the block raises.
    """
    observers = observers_of(prepared)
    previous = {name: obs.enabled for name, obs in observers.items()}
    for obs in observers.values():
        obs.enabled = True
    try:
        with torch.inference_mode():
            yield observers
    finally:
        for name, obs in observers.items():
            obs.enabled = previous[name]

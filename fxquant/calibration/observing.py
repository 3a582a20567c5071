"""``observing(prepared)``: let users drive their own calibration loop."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from fxquant.calibration.memory_format import channels_last_convs
from fxquant.observers import Observer
from fxquant.state import STATE_KEY, QuantState


def _channels_last(prepared: nn.Module) -> bool:
    state = getattr(prepared, "meta", {}).get(STATE_KEY)
    return isinstance(state, QuantState) and state.channels_last


def observers_of(model: nn.Module) -> dict[str, Observer]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Observer)}


@contextlib.contextmanager
def observers_kept(model: nn.Module) -> Iterator[None]:
    """Run ``model`` in the block without calibrating it: every observer's state is put back on exit (a run for
    another purpose, such as checking islands or counting multiply-adds, must not become calibration data)."""
    saved = [(observer, copy.deepcopy(observer.__dict__)) for observer in observers_of(model).values()]
    try:
        yield
    finally:
        for observer, state in saved:
            observer.__dict__.clear()
            observer.__dict__.update(state)


@contextlib.contextmanager
def observing(prepared: nn.Module) -> Iterator[dict[str, Observer]]:
    """Enable every observer of ``prepared`` and run the block under ``torch.inference_mode()``.

    Where prepare() found that the model runs that way, Conv2d weights are channels-last inside the block (faster
    float convolutions; see :mod:`fxquant.calibration.memory_format`), and put back on exit.

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
        with channels_last_convs(prepared, enabled=_channels_last(prepared)), torch.inference_mode():
            yield observers
    finally:
        for name, obs in observers.items():
            obs.enabled = previous[name]

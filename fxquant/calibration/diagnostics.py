"""What a calibration run should warn about: too little data, and channels whose ranges differ by orders of magnitude.

*Too few samples.* A range estimated from a handful of samples is a guess: fewer than ``MIN_SAMPLES`` (32) samples
in the whole run draws a warning, and so does any observer that saw fewer than ``MIN_ELEMENTS`` (1,024) values, or,
for a ``percentile`` observer, fewer than ``TAIL_VALUES`` (10) values beyond its percentile (99.99 needs 100,000
values: below that, the "percentile" is just the extreme value).

*Channel spread.* Per-tensor activation quantization gives every channel the same scale. When a few channels are
more than ``SPREAD_RATIO`` (32) times larger than the median channel (among channels that are not all zero), they
set the scale and the median channel keeps at most 256 / 32 = 8 of the 256 levels: cross-layer equalization
(``QuantConfig(equalize=True)``), SmoothQuant (``smoothquant_alpha``) or an observer that clips
(``percentile``/``entropy``/``mse``) helps. Observers keep per-tensor statistics only, so the per-channel ranges
come from one extra pass over the first batch with an ``fx.Interpreter`` that reads each observed value (observers
are bypassed, their statistics do not change). The channel axis is the last one for values that a Linear produces or
consumes, dim 1 for Conv and for other tensors of 2, 4 or 5 dims, and the last one for other 3-D tensors (``(batch,
tokens, features)``, the transformer layout).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxquant.observers import Observer

log = logging.getLogger(__name__)

MIN_SAMPLES = 32
MIN_ELEMENTS = 1024
TAIL_VALUES = 10
SPREAD_RATIO = 32.0
_LISTED_CHANNELS = 8  # outlier channels named per observer in the summary


@dataclass(frozen=True)
class SparseObserver:
    """An observer that saw ``elements`` values, fewer than the ``needed`` for a reliable range."""

    label: str
    elements: int
    needed: int


@dataclass(frozen=True)
class ChannelSpread:
    """Channels of one observed value whose max ``|x|`` exceeds ``SPREAD_RATIO`` times the median channel's.

    ``outliers`` holds ``(channel index, max |x|)``, largest first (at most 8); ``count`` is how many there are.
    """

    label: str
    axis: int
    channels: int
    median_amax: float
    count: int
    outliers: tuple[tuple[int, float], ...]

    @property
    def ratio(self) -> float:
        return self.outliers[0][1] / self.median_amax if self.median_amax > 0 else math.inf

    def __str__(self) -> str:
        named = ", ".join(f"ch {c}: {v:.3g}" for c, v in self.outliers)
        more = f" (+{self.count - len(self.outliers)} more)" if self.count > len(self.outliers) else ""
        return (f"{self.label}: {self.count} of {self.channels} channels (axis {self.axis}) exceed "
                f"{SPREAD_RATIO:g}x the median max|x| {self.median_amax:.3g}: {named}{more}")


def needed_elements(observer: Observer) -> int:
    """How many values ``observer`` needs before its range is more than a guess (see the module docstring)."""
    percentile = getattr(observer, "percentile", None)
    if isinstance(percentile, float) and percentile < 100:
        return max(MIN_ELEMENTS, math.ceil(TAIL_VALUES / (1 - percentile / 100)))
    return MIN_ELEMENTS


def sparse_observers(observers: Mapping[str, Observer]) -> list[SparseObserver]:
    """Activation observers that saw some data, but too little of it (observers that saw none are reported apart;
    statistics observers, a mean or a per-channel range for a convert-time pass, need no particular count)."""
    found = []
    for obs in observers.values():
        if obs.kind != "activation":
            continue
        needed = needed_elements(obs)
        if obs.has_data and int(obs.num_elements) < needed:
            found.append(SparseObserver(obs.label, int(obs.num_elements), needed))
    return found


def sample_warnings(samples: int, sparse: Sequence[SparseObserver]) -> list[str]:
    """Human-readable warnings about the amount of calibration data."""
    warnings = []
    if samples < MIN_SAMPLES:
        warnings.append(f"only {samples} calibration samples (fewer than {MIN_SAMPLES}): ranges may not represent "
                        "real inputs; calibrate on more data")
    warnings += [f"{s.label} saw {s.elements} values, fewer than the {s.needed} a reliable range needs" for s in sparse]
    return warnings


def _axis_preference(node: fx.Node, modules: Mapping[str, nn.Module]) -> int | None:
    """-1 when a Linear produces or reads the observed value, 1 for a Conv, None when neither does."""
    neighbours = [a for a in node.args[:1] if isinstance(a, fx.Node)] + list(node.users)
    for other in neighbours:
        module = modules.get(str(other.target)) if other.op == "call_module" else None
        inner = getattr(module, "inner", module)  # fused Linear/Conv + activation modules wrap the layer
        if isinstance(inner, nn.Linear):
            return -1
        if isinstance(inner, nn.modules.conv._ConvNd):
            return 1
    return None


class _ChannelRecorder(fx.Interpreter):
    """Runs the graph once, bypassing observers, and records each observed value's per-channel max ``|x|``."""

    def __init__(self, gm: fx.GraphModule, observers: Mapping[str, Observer]) -> None:
        super().__init__(gm)
        self.observers = observers
        modules = dict(gm.named_modules())
        self.preference = {str(n.target): _axis_preference(n, modules)
                           for n in gm.graph.find_nodes(op="call_module") if str(n.target) in observers}
        self.amax: dict[str, tuple[int, torch.Tensor]] = {}

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if str(target) not in self.observers:
            return super().call_module(target, args, kwargs)
        x = args[0]
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2 and x.numel() > 0:
            preference = self.preference.get(str(target))
            axis = preference if preference is not None else (-1 if x.dim() == 3 else 1)
            axis %= x.dim()
            dims = [d for d in range(x.dim()) if d != axis]
            self.amax[str(target)] = (axis, x.detach().abs().amax(dim=dims).float())
        return x


def _spread(label: str, axis: int, amax: torch.Tensor) -> ChannelSpread | None:
    """Channels above ``SPREAD_RATIO`` times the median of the live channels (all-zero ones cost per-tensor nothing)."""
    live = amax[amax > 0]
    if live.numel() == 0:
        return None
    median = float(live.median())
    over = torch.nonzero(amax > SPREAD_RATIO * median).flatten()
    if over.numel() == 0:
        return None
    values = amax[over]
    order = torch.argsort(values, descending=True)[:_LISTED_CHANNELS]
    outliers = tuple((int(over[i]), float(values[i])) for i in order)
    return ChannelSpread(label, axis, amax.numel(), median, int(over.numel()), outliers)


def channel_spreads(gm: fx.GraphModule, observers: Mapping[str, Observer], args: tuple[Any, ...],
                    kwargs: Mapping[str, Any]) -> list[ChannelSpread]:
    """Observed values of one batch whose channels differ by more than ``SPREAD_RATIO``, in graph order."""
    recorder = _ChannelRecorder(gm, observers)
    try:
        with torch.inference_mode():
            recorder.run(*_positional(gm, args, kwargs))
    except Exception as exc:  # a hint must never fail the calibration it comments on
        log.warning("calibration: per-channel diagnostics skipped (%s: %s)", type(exc).__name__, exc)
        return []
    spreads = (_spread(observers[name].label, axis, amax) for name, (axis, amax) in recorder.amax.items())
    return [s for s in spreads if s is not None]


def _positional(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Any]:
    """The forward's inputs as one positional list (``fx.Interpreter.run`` takes no keywords); defaults fill gaps."""
    values = list(args)
    for node in list(gm.graph.find_nodes(op="placeholder"))[len(args):]:
        name = str(node.target).lstrip("*")
        values.append(kwargs[name] if name in kwargs else (node.args[0] if node.args else None))
    return values

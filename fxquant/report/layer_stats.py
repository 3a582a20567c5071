"""Running statistics of one layer's outputs: error energies, value range and a bounded sample for histograms.

Energies are summed in float64 over every batch, so the SQNR of a layer is that of all its outputs together, not a
mean of per-batch dBs (which would overweight easy batches).
"""

from __future__ import annotations

import math

import torch

from fxquant.report.metrics import energy_ratio_db
from fxquant.report.sections import Histogram

HISTOGRAM_BINS = 40
_SAMPLE_PER_BATCH = 4096
_SAMPLE_TOTAL = 32768


def histogram(values: torch.Tensor, bins: int = HISTOGRAM_BINS) -> Histogram:
    """Equal-width histogram of ``values`` over their own range."""
    values = values.detach().double().reshape(-1)
    low, high = float(values.min()), float(values.max())
    if high <= low:
        high = low + 1e-12
    counts = torch.histc(values, bins=bins, min=low, max=high)
    return Histogram(low, high, tuple(int(c) for c in counts))


class _Energy:
    """``sum(reference^2)`` and ``sum((reference - approx)^2)``."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.seen = False

    def add(self, reference: torch.Tensor, approx: torch.Tensor) -> None:
        ref = reference.double()
        self.signal += float(ref.pow(2).sum())
        self.noise += float((ref - approx.double()).pow(2).sum())
        self.seen = True

    def db(self) -> float | None:
        return energy_ratio_db(self.signal, self.noise) if self.seen else None


class LayerStats:
    """What the report keeps of one layer's outputs across batches."""

    def __init__(self) -> None:
        self.cumulative = _Energy()
        self.isolated = _Energy()
        self.low, self.high = math.inf, -math.inf
        self.samples: list[torch.Tensor] = []
        self.sampled = 0

    def update(self, float_out: torch.Tensor, quant_out: torch.Tensor, isolated: torch.Tensor | None) -> None:
        """Add one batch: the float reference output, the quantized model's output, the isolated layer's output."""
        self.cumulative.add(float_out, quant_out)
        if isolated is not None:
            self.isolated.add(float_out, isolated)
        flat = float_out.reshape(-1)
        if flat.numel():
            self.low, self.high = min(self.low, float(flat.min())), max(self.high, float(flat.max()))
        if self.sampled < _SAMPLE_TOTAL and flat.numel():
            step = max(1, flat.numel() // _SAMPLE_PER_BATCH)
            sample = flat[::step][: _SAMPLE_TOTAL - self.sampled].clone()
            self.samples.append(sample)
            self.sampled += sample.numel()

    def sqnr_db(self) -> float | None:
        return self.cumulative.db()

    def isolated_sqnr_db(self) -> float | None:
        return self.isolated.db()

    def range(self) -> tuple[float, float] | None:
        return (self.low, self.high) if self.low <= self.high else None

    def histogram(self) -> Histogram | None:
        return histogram(torch.cat(self.samples)) if self.samples else None

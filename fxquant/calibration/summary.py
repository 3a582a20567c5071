"""``CalibrationSummary``: what a calibration run saw, and what it should warn the user about."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fxquant.calibration.diagnostics import ChannelSpread, SparseObserver, sample_warnings, sparse_observers
from fxquant.observers import Observer

LISTED_RANGES = 24  # observer ranges printed by str(); more are summarized by the widest


@dataclass
class CalibrationSummary:
    """What a calibration run saw: batches, samples, the range each observer recorded, and diagnostics.

    ``skipped_batches`` holds the stream indices of batches skipped for NaN/Inf (``skip_nonfinite=True``);
    ``unobserved`` the observers that saw no data (``convert`` keeps their layers float, or refuses them with
    ``QuantConfig(unobserved="error")``); ``sparse`` the observers that saw
    too little for a reliable range and ``warnings`` every such warning as text; ``channel_spreads`` the observed
    values whose channels differ by orders of magnitude (``diagnose=True``); ``resumed_batches`` how many batches
    came from a checkpoint rather than from this call. Counts cover all ranks after a distributed run.
    """

    batches: int
    samples: int
    seconds: float
    skipped_batches: list[int] = field(default_factory=list)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    unobserved: list[str] = field(default_factory=list)
    sparse: list[SparseObserver] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    channel_spreads: list[ChannelSpread] = field(default_factory=list)
    resumed_batches: int = 0

    def record_observers(self, observers: Mapping[str, Observer]) -> None:
        """Fill ``ranges``, ``unobserved``, ``sparse`` and ``warnings`` from the observers' final statistics."""
        for obs in observers.values():
            if obs.has_data:
                self.ranges[obs.label] = (float(obs.min_val), float(obs.max_val))
            else:
                self.unobserved.append(obs.label)
        self.sparse = sparse_observers(observers)
        self.warnings = sample_warnings(self.samples, self.sparse)

    def __str__(self) -> str:
        lines = [f"calibrated on {self.samples} samples in {self.batches} batches ({self.seconds:.2f} s)"]
        if self.resumed_batches:
            lines.append(f"resumed from a checkpoint after {self.resumed_batches} batches")
        if self.skipped_batches:
            lines.append(f"skipped {len(self.skipped_batches)} batches with NaN/Inf: {self.skipped_batches}")
        listed = self.ranges.items()
        if len(self.ranges) > LISTED_RANGES:  # an LLM has hundreds: the widest say the most
            widest = sorted(self.ranges.items(), key=lambda item: item[1][0] - item[1][1])[:LISTED_RANGES]
            lines.append(f"the {LISTED_RANGES} widest of {len(self.ranges)} ranges (all of them: summary.ranges, "
                         "or --json on the command line):")
            listed = dict(widest).items()
        lines += [f"  {label}: [{lo:.4g}, {hi:.4g}]" for label, (lo, hi) in listed]
        lines += [f"  {label}: saw no data (its layers stay float at convert)" for label in self.unobserved]
        lines += [f"warning: {text}" for text in self.warnings]
        if self.channel_spreads:
            lines.append("channels whose ranges differ by orders of magnitude (per-tensor scales waste levels on the "
                         "small ones; try QuantConfig(equalize=True), smoothquant_alpha, or a clipping observer):")
            lines += [f"  {spread}" for spread in self.channel_spreads]
        return "\n".join(lines)

"""``minmax``: the running minimum and maximum, exact and mergeable across shards."""

from __future__ import annotations

import torch

from fxquant.observers.base import Observer


class MinMaxObserver(Observer):
    """Range = [min, max] of everything seen. Fast and exact, but one outlier stretches the whole range."""
    name = "minmax"

    @classmethod
    @torch.no_grad()
    def over_channels(cls, channel_min: torch.Tensor, channel_max: torch.Tensor, counts: Observer,
                      label: str) -> MinMaxObserver:
        """The observer of a value whose channels' ranges are known: ``[min(channel_min), max(channel_max)]``, with
        the update and element counts of ``counts`` (the observer that saw the value); e.g. SmoothQuant's smoothed
        input, whose per-tensor range follows exactly from the unsmoothed channels' ranges divided by ``s``."""
        observer = cls()
        observer.min_val.copy_(channel_min.min())
        observer.max_val.copy_(channel_max.max())
        observer.num_updates.copy_(counts.num_updates)
        observer.num_elements.copy_(counts.num_elements)
        observer.label = label
        return observer

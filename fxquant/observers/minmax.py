"""``minmax``: the running minimum and maximum, exact and mergeable across shards."""

from __future__ import annotations

from fxquant.observers.base import Observer


class MinMaxObserver(Observer):
    """Range = [min, max] of everything seen. Fast and exact, but one outlier stretches the whole range."""
    name = "minmax"

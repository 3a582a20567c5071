"""``moving_average``: exponential moving average of each batch's min and max."""

from __future__ import annotations

from typing import Any

import torch

from fxquant.errors import ConfigError
from fxquant.observers.base import Observer


class MovingAverageObserver(Observer):
    """Range = EMA of per-batch min/max: a rare extreme batch moves the range by ``averaging_constant`` only.

    Options: ``averaging_constant`` (default 0.01, in (0, 1]; 1 keeps only the last batch). The first batch sets the
    averages; each later one moves them by ``averaging_constant * (batch_value - average)``. State: two float32
    buffers (``ema_min``, ``ema_max``) on top of the running min/max every observer keeps.

    ``merge`` averages the two shards' EMAs weighted by their number of batches: an EMA is not associative, so no
    rule reproduces a single run exactly; weighting by batches keeps the merge symmetric, equal to either side when
    the other saw no data, and exact when both shards converged to the same values.

    Example::

        obs = MovingAverageObserver(averaging_constant=0.1)
        obs(torch.randn(32, 10))
    """
    name = "moving_average"

    # Buffers, declared for type checkers (nn.Module.__getattr__ is typed Tensor | Module).
    ema_min: torch.Tensor
    ema_max: torch.Tensor

    def __init__(self, *, averaging_constant: float = 0.01, **options: Any) -> None:
        super().__init__(**options)
        c = averaging_constant
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1:
            raise ConfigError(f"MovingAverageObserver: averaging_constant must be in (0, 1], got {c!r}")
        self.averaging_constant = float(c)
        self.register_buffer("ema_min", torch.tensor(float("inf")))
        self.register_buffer("ema_max", torch.tensor(float("-inf")))

    def _update(self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if not self.has_data:
            self.ema_min.copy_(lo)
            self.ema_max.copy_(hi)
            return
        self.ema_min.add_(self.averaging_constant * (lo.float() - self.ema_min))
        self.ema_max.add_(self.averaging_constant * (hi.float() - self.ema_max))

    def _merge(self, other: Observer) -> None:
        assert isinstance(other, MovingAverageObserver)  # Observer.merge checked the type
        if not self.has_data:
            self.ema_min.copy_(other.ema_min)
            self.ema_max.copy_(other.ema_max)
            return
        mine, theirs = float(self.num_updates), float(other.num_updates)
        for own, their in ((self.ema_min, other.ema_min), (self.ema_max, other.ema_max)):
            own.copy_((own * mine + their * theirs) / (mine + theirs))

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return super().range()
        return self.ema_min.clone(), self.ema_max.clone()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, averaging_constant={self.averaging_constant:g}"

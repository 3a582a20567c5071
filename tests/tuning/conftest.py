"""The accuracy-budget search tests measure each trial's latency but never assert on it: a short budget keeps them
fast."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _short_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fxquant.tuning.budget.LATENCY_BUDGET_S", 0.02)

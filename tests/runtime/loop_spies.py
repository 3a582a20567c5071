"""A spy standing for one of a runtime module's loop wrappers (shared by the runtime tests): it counts the calls that
ran the loop, so no test passes by comparing torch's path with itself."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


class LoopSpy:
    """Calls the wrapper it stands for; ``ran`` counts the calls that returned True (the loop wrote the result)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.ran = inner, 0

    def __call__(self, *args: Any) -> bool:
        ran = self.inner(*args)
        self.ran += bool(ran)
        return ran


def spy_on(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> LoopSpy:
    """``module.name`` replaced by a :class:`LoopSpy` on it for the test."""
    spy = LoopSpy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    return spy

"""Name -> observer class registry: what ``QuantConfig(activation=...)`` and ``weight=...`` refer to.

A duplicate name raises; an unknown name raises listing the known ones. Users add their own with
``@register_observer("name")``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TypeVar

from fxquant.errors import ConfigError
from fxquant.observers import builtin
from fxquant.observers.base import Observer, WeightObserver

_ACTIVATION: dict[str, type[Observer]] = {cls.name: cls for cls in builtin.ACTIVATION}
_WEIGHT: dict[str, type[WeightObserver]] = {cls.name: cls for cls in builtin.WEIGHT}

T = TypeVar("T", bound=type)


def register_observer(name: str) -> Callable[[T], T]:
    """Class decorator registering an activation ``Observer`` or a ``WeightObserver`` under ``name``."""

    def decorate(cls: T) -> T:
        table: dict = _WEIGHT if issubclass(cls, WeightObserver) else _ACTIVATION
        if not issubclass(cls, (Observer, WeightObserver)):
            raise TypeError(f"{cls.__name__} is neither an Observer nor a WeightObserver")
        if name in table:
            raise ConfigError(f"an observer named {name!r} is already registered ({table[name].__name__})")
        cls.name = name
        table[name] = cls
        return cls

    return decorate


def _lookup(table: dict[str, type], name: str, what: str) -> type:
    if name not in table:
        near = difflib.get_close_matches(name, list(table), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"unknown {what} observer {name!r}.{hint} Known: {', '.join(sorted(table))}.")
    return table[name]


def get_activation_observer(name: str) -> type[Observer]:
    return _lookup(_ACTIVATION, name, "activation")


def get_weight_observer(name: str) -> type[WeightObserver]:
    return _lookup(_WEIGHT, name, "weight")


def activation_observer_names() -> tuple[str, ...]:
    return tuple(sorted(_ACTIVATION))


def weight_observer_names() -> tuple[str, ...]:
    return tuple(sorted(_WEIGHT))


"""Reading report dicts back: every missing key or wrong type raises ``ArtifactError`` naming the JSON path.

A report is often read from a file another machine wrote (a CI baseline), so its errors must say which key of which
file is wrong, not fail later with a ``KeyError`` deep in the regression gate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fxquant.errors import ArtifactError

_NUMBER = (int, float)


def _type_name(kinds: type | tuple[type, ...]) -> str:
    names = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true/false", "list": "a list",
             "dict": "an object", "Mapping": "an object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k.__name__, k.__name__) for k in kinds))


def section(data: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> Mapping[str, Any] | None:
    """The object at ``data[key]``; None when it is absent and not ``required``."""
    if key not in data and not required:
        return None
    value = read(data, key, Mapping, where)
    assert isinstance(value, Mapping)
    return value


def read(data: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    """``data[key]`` checked against ``kinds`` (booleans are not numbers)."""
    if not isinstance(data, Mapping):
        raise ArtifactError(f"{where}: expected an object, got {type(data).__name__}")
    if key not in data:
        raise ArtifactError(f"{where}: missing key {key!r}")
    value = data[key]
    accept = _NUMBER if kinds is float else kinds
    if (accept in (_NUMBER, int) and isinstance(value, bool)) or not isinstance(value, accept):
        raise ArtifactError(f"{where}.{key}: expected {_type_name(kinds)}, got {value!r}")
    return value


def number(data: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    """A number; ``null`` reads as +inf (how JSON, which has no infinity, stores an exact SQNR)."""
    if key not in data and default is not None:
        return default
    if key in data and data[key] is None:
        return math.inf
    return float(read(data, key, float, where))


def optional_number(data: Mapping[str, Any], key: str, where: str) -> float | None:
    """An optional number: None when the key is absent, +inf when it is ``null``."""
    return number(data, key, where) if key in data else None


def number_pair(data: Mapping[str, Any], key: str, where: str) -> tuple[float, float] | None:
    """An optional ``[low, high]`` pair."""
    if data.get(key) is None:
        return None
    value = read(data, key, list, where)
    if len(value) != 2 or not all(isinstance(v, _NUMBER) and not isinstance(v, bool) for v in value):
        raise ArtifactError(f"{where}.{key}: expected [low, high], got {value!r}")
    return float(value[0]), float(value[1])


def items(data: Mapping[str, Any], key: str, where: str) -> Sequence[Any]:
    value = read(data, key, list, where)
    assert isinstance(value, list)
    return value


def finite_or_none(value: float) -> float | None:
    """JSON has no infinity or NaN: an exact (infinite) SQNR is written as ``null``."""
    return value if math.isfinite(value) else None

"""Name -> backend registry. ``get_backend`` raises ``BackendUnavailableError`` listing what this machine has."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from fxquant.errors import BackendUnavailableError, ConfigError
from fxquant.kernels.base import Backend

_BACKENDS: dict[str, type[Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
# Built-in backends live in these modules; importing one registers it.
_BUILTIN_MODULES = ("fxquant.kernels.torch_engines.backends", "fxquant.kernels.reference",
                    "fxquant.kernels.onednn.backend")

B = TypeVar("B", bound=type[Backend])


def register_backend(name: str) -> Callable[[B], B]:
    def decorate(cls: B) -> B:
        if name in _BACKENDS:
            raise ConfigError(f"a backend named {name!r} is already registered")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return decorate


def _ensure_builtin() -> None:
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def available_backends() -> tuple[str, ...]:
    """Names of registered backends that this torch build and CPU can run."""
    _ensure_builtin()
    return tuple(name for name, cls in sorted(_BACKENDS.items()) if cls.is_available())


# The default's order of preference: oneDNN (plain int8 tensors; fxquant's fastest backend on the zoo's convnets and
# transformers, with or without AMX: docs/backends.md), then the engines on torch's deprecated quantized dtypes, then
# the reference.
DEFAULT_PREFERENCE = ("onednn", "fbgemm", "qnnpack", "reference")


def default_backend() -> str:
    """The backend ``QuantConfig()`` uses on this machine: the first of :data:`DEFAULT_PREFERENCE` that this torch
    build and CPU run. fbgemm and qnnpack stay opt-in wherever oneDNN is there, because they need the quantized
    dtypes that torch 2.13 deprecates."""
    available = available_backends()
    return next(name for name in DEFAULT_PREFERENCE if name in available)


def get_backend(name: str) -> Backend:
    """The shared instance of backend ``name``."""
    _ensure_builtin()
    if name not in _BACKENDS or not _BACKENDS[name].is_available():
        raise BackendUnavailableError(
            f"backend {name!r} is not available in this torch build/CPU; available: "
            f"{', '.join(available_backends()) or 'none'}"
        )
    if name not in _INSTANCES:
        _INSTANCES[name] = _BACKENDS[name]()
    return _INSTANCES[name]

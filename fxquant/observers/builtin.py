"""Imports every built-in observer module so that each registers itself."""

from fxquant.observers import minmax, weight  # noqa: F401

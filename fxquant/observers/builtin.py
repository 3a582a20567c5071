"""Imports every built-in observer module so that each registers itself."""

from fxquant.observers import entropy, histogram, minmax, moving_average, mse, percentile, weight  # noqa: F401

"""Searches built on the api: the accuracy-budget fallback (:mod:`~fxquant.tuning.budget`), per-layer sensitivity
(:mod:`~fxquant.tuning.sensitivity`) and ``fxquant.quantize`` (:mod:`~fxquant.tuning.quantize`)."""

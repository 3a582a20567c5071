"""Graph passes: each takes an ``fx.GraphModule`` and returns it rewritten (lint-checked and recompiled)."""

from fxquant.passes.fold_bn import fold_batchnorm
from fxquant.passes.functional import functional_to_modules
from fxquant.passes.fuse import fuse_activations
from fxquant.passes.insert_observers import insert_observers
from fxquant.passes.lower import lower_to_int8

__all__ = ["fold_batchnorm", "functional_to_modules", "fuse_activations", "insert_observers", "lower_to_int8"]

"""The prepare pipeline: the passes every traced graph goes through, in order, as one named list.

Each pass is a no-op unless its pattern appears or the config asks for it. A pass that fails on a graph carries
its name in the error (as torch.fx's pass manager does), so a report names the step, not only the torch.fx frame.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import fx

from fxquant.config import QuantConfig
from fxquant.errors import FxQuantError
from fxquant.passes.attention import fuse_attention
from fxquant.passes.bias_correction import insert_bias_observers
from fxquant.passes.equalize import equalize_layers
from fxquant.passes.fold_bn import fold_batchnorm
from fxquant.passes.functional import functional_to_modules
from fxquant.passes.fuse import fuse_activations
from fxquant.passes.insert_observers import insert_observers
from fxquant.passes.smoothquant import insert_smoothing_observers
from fxquant.passes.token_ranges import insert_token_range_observers

ConfiguredPass = Callable[[fx.GraphModule, QuantConfig, str], fx.GraphModule]


class Pass(NamedTuple):
    name: str
    run: ConfiguredPass


def _graph_only(transform: Callable[[fx.GraphModule], fx.GraphModule]) -> ConfiguredPass:
    return lambda gm, _config, _prefix: transform(gm)


PREPARE: tuple[Pass, ...] = (
    Pass("fuse_attention", _graph_only(fuse_attention)),  # attention written out -> one SDPA call
    Pass("functional_to_modules", _graph_only(functional_to_modules)),  # F.linear/F.conv on parameters -> modules
    Pass("fold_batchnorm", _graph_only(fold_batchnorm)),
    Pass("fuse_activations", _graph_only(fuse_activations)),  # Linear/Conv + ReLU-like -> one fused module
    Pass("equalize_layers", equalize_layers),  # cross-layer equalization, when the config asks for it
    Pass("insert_observers", insert_observers),
    Pass("insert_smoothing_observers", insert_smoothing_observers),  # SmoothQuant's statistics, when asked for
    Pass("insert_bias_observers", insert_bias_observers),  # bias correction's statistics, when asked for
    Pass("insert_token_range_observers", insert_token_range_observers),  # static_outliers layers' input ranges
)


def prepare_graph(gm: fx.GraphModule, config: QuantConfig, prefix: str = "") -> fx.GraphModule:
    """``gm`` through every pass of :data:`PREPARE`; ``prefix``: the module path of ``gm`` inside the user's model
    (an INT8 island's), so config patterns and errors see full paths."""
    for step in PREPARE:
        gm = run_pass(step, gm, config, prefix)
    return gm


def run_pass(step: Pass, gm: fx.GraphModule, config: QuantConfig, prefix: str) -> fx.GraphModule:
    """One pass; an unexpected error (not one of fxquant's own, which already name cause and fix) gets a note naming
    the pass and the graph."""
    try:
        return step.run(gm, config, prefix)
    except FxQuantError:
        raise
    except Exception as error:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"fxquant: raised in the prepare pass {step.name!r} (fxquant.passes.pipeline) on the "
                           f"graph of {prefix.rstrip('.') or 'the model'}")
        raise

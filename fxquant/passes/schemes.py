"""The float-in, float-out schemes (``QuantConfig(scheme="dynamic" | "weight_only")``): which layers take them, and
the swap that gives them their INT8 modules.

A dynamic or weight-only Linear reads and returns float, so to every other pass it is a float layer: prepare gives
it no observers (:func:`resolve_scheme` marks its settings ``quantize=False`` with the scheme), ``convert(...,
schemes=...)`` takes calibrated static layers out of the static flow the way ``keep_float`` does
(:func:`~fxquant.passes.keep_float.keep_layers_float`), and after lowering :func:`lower_schemes` replaces each such
float Linear by :class:`~fxquant.nn.schemes.DynamicInt8Linear` or :class:`~fxquant.nn.schemes.WeightOnlyInt8Linear`.
The schemes apply to Linear layers (and transformers' ``Conv1D``, traced as one); a convolution a scheme pattern
matches stays static W8A8.
"""

from __future__ import annotations

from dataclasses import replace

from torch import fx, nn

from fxquant.config import LayerSettings
from fxquant.errors import CalibrationError
from fxquant.nn.fused import Fused, compute_module
from fxquant.nn.island import SURFACE_KEY, Island, Surface
from fxquant.nn.schemes import SCHEME_MODULES, SchemeLinear, StaticOutliersInt8Linear
from fxquant.passes._graph import modules_of, nodes_of, replace_submodule
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.smoothquant_auto import SMOOTHQUANT_KEY
from fxquant.passes.token_ranges import TOKEN_RANGE


def takes_scheme(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` calls a layer a float-in, float-out scheme applies to: a Linear, plain or fused."""
    module = modules_of(gm).get(str(node.target)) if node.op == "call_module" else None
    return module is not None and isinstance(compute_module(module), nn.Linear)


def resolve_scheme(settings: LayerSettings, layer: nn.Module) -> LayerSettings:
    """A layer's prepare-time settings under its scheme: a quantized Linear on a float-in, float-out scheme gets no
    observers (``quantize=False``, the scheme kept); any other layer runs static W8A8 or float as configured."""
    if settings.scheme == "static":
        return settings
    if settings.quantize and isinstance(layer, nn.Linear):
        return replace(settings, quantize=False)
    return replace(settings, scheme="static")


def scheme_layers(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` whose layers run a float-in, float-out scheme."""
    return [node for node in nodes_of(gm) if node.op == "call_module" and LAYER_SETTINGS in node.meta
            and not node.meta[LAYER_SETTINGS].quantize and node.meta[LAYER_SETTINGS].scheme != "static"]


def lower_schemes(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each float Linear of ``gm`` marked with a float-in, float-out scheme by its INT8 module (in place; a
    fused activation stays around it). Returns ``gm``."""
    modules = modules_of(gm)
    for node in {str(n.target): n for n in scheme_layers(gm)}.values():  # a layer called twice is swapped once
        settings: LayerSettings = node.meta[LAYER_SETTINGS]
        module = modules[str(node.target)]
        linear = compute_module(module)
        assert isinstance(linear, nn.Linear)
        int8 = _scheme_module(node, linear, settings)
        if isinstance(module, Fused):
            module.inner = int8
        else:
            replace_submodule(gm, str(node.target), int8)
    return gm


def _scheme_module(node: fx.Node, linear: nn.Linear, settings: LayerSettings) -> SchemeLinear:
    if settings.scheme != "static_outliers":
        return SCHEME_MODULES[settings.scheme].from_float(linear, settings.weight)
    observer = node.meta.get(TOKEN_RANGE)
    if observer is None:
        raise CalibrationError(f"{node.target}: a static_outliers layer without its calibrated token ranges; "
                               "convert the prepared, calibrated model (fxquant.convert(prepared))")
    return StaticOutliersInt8Linear.from_observed(linear, settings.weight, observer.activation)


def unwrap_layer_islands(model: nn.Module) -> nn.Module:
    """Put each island of one Linear that became a float-in, float-out INT8 module in its place, bare (in place;
    returns ``model``): it reads and returns float like the Linear, answers what user code reads from one (see
    :mod:`fxquant.nn.schemes`), and skips an island's graph walk, a large share of an LLM decode step. Run after
    :func:`~fxquant.passes.fold_scales.fold_channel_scales`, which moves a SmoothQuant scale in front into the
    module; an island computing anything else stays, and so do islands of transformers' ``Conv1D``: they give its
    transposed weight layout."""
    for path, island in list(model.named_modules()):
        surface = island.meta.get(SURFACE_KEY) if isinstance(island, Island) else None
        if isinstance(surface, Surface) and surface.layer is not None and not surface.transposed:
            bare = _bare_layer(island, surface.layer)
            if bare is not None:
                if SMOOTHQUANT_KEY in island.meta:  # what SmoothQuant did there stays readable (smoothing_choices)
                    bare.meta = {SMOOTHQUANT_KEY: island.meta[SMOOTHQUANT_KEY]}
                replace_submodule(model, path, bare)
    return model


def _bare_layer(island: fx.GraphModule, name: str) -> SchemeLinear | None:
    """The layer ``name`` of ``island``, a float-in, float-out INT8 Linear, if the island's graph is ``x ->
    <name>(x)``; else None."""
    layer = island.get_submodule(name)
    computing = [node for node in island.graph.nodes if node.op not in ("placeholder", "output")]
    if not isinstance(layer, SchemeLinear) or len(computing) != 1 or computing[0].target != name \
            or [node.op for node in computing[0].all_input_nodes] != ["placeholder"]:
        return None
    return layer

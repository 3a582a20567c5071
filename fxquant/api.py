"""The public pipeline: prepare -> calibrate -> convert (and quantize, all three at once).

Each step is a short sequence of passes; the heavy lifting lives in :mod:`fxquant.passes`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from fxquant.calibration import observers_of
from fxquant.calibration.memory_format import runs_channels_last
from fxquant.calibration.observing import observers_kept
from fxquant.config import SCHEMES, QuantConfig
from fxquant.errors import CalibrationError, ConfigError, InputError, TraceError
from fxquant.kernels.registry import get_backend
from fxquant.nn.fused import COMPUTE_TYPES
from fxquant.observers import switch_method
from fxquant.passes import (
    ChannelRangeObserver,
    StatisticsObserver,
    correct_biases,
    keep_layers_float,
    lower_to_int8,
    smooth_activations,
    smoothquant_alphas,
)
from fxquant.passes._graph import replace_submodule
from fxquant.passes.fold_scales import fold_channel_scales
from fxquant.passes.islands import (
    lower_islands,
    prepare_islands,
    prepared_islands,
    wrap_untraceable_root,
)
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.pipeline import prepare_graph
from fxquant.passes.schemes import lower_schemes, scheme_layers, unwrap_layer_islands
from fxquant.passes.smoothquant_auto import AUTO
from fxquant.passes.tied_embeddings import head_column_scales, share_tied_embeddings, tied_heads
from fxquant.passes.token_ranges import attach_token_ranges
from fxquant.passes.unobserved import keep_unobserved_float, unobserved_layers
from fxquant.runtime import runner
from fxquant.runtime.auto_backend import FAMILIES, convert_auto, family_of, relower_layers
from fxquant.runtime.hf_attention import attention_for_backend
from fxquant.state import NONE, STATE_KEY, WRAPPED, InputSpec, QuantState, drop_in, quant_state, update_state
from fxquant.tracing import GraphBreak, trace, trace_partially, user_location

log = logging.getLogger(__name__)
FLOAT_IO_SCHEMES = tuple(s for s in SCHEMES if s not in ("static", "static_outliers"))  # convert can switch to


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise InputError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not any(isinstance(m, COMPUTE_TYPES) for m in model.modules()) and not _has_functional_layers(model):
        raise InputError(f"{type(model).__name__} has no Linear or Conv layer, so there is nothing fxquant can run "
                         "in INT8; quantize a model that has them (ops like ReLU or pooling only run INT8 between "
                         "them)")
    if model.training:
        raise InputError(f"{type(model).__name__} is in training mode; call model.eval() first (post-training "
                         "quantization folds BatchNorm running statistics and drops dropout)")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type != "cpu":
            raise InputError(f"{name} is on {tensor.device}; fxquant targets CPU kernels: call model.cpu() first")
    for name, parameter in model.named_parameters():  # not buffers: attention masks hold -inf by design
        if parameter.is_floating_point() and not bool(torch.isfinite(parameter).all()):
            raise InputError(f"parameter {name} holds NaN or Inf values: no scale can represent it; fix the "
                             "checkpoint (or the training run that produced it) first")


def _has_functional_layers(model: nn.Module) -> bool:
    """A model without Linear/Conv modules may still call ``F.linear``/``F.convNd`` on parameters of >= 2 dims."""
    return any(p.dim() >= 2 for p in model.parameters())


def check_example_inputs(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(f"example_inputs must be a tuple of positional inputs, e.g. (x,), "
                         f"got {type(example_inputs).__name__}")
    return tuple(example_inputs)


def _describe(inputs: tuple[Any, ...]) -> str:
    return ", ".join(f"Tensor{tuple(v.shape)}:{v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
                     for v in inputs)


def _run_example(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> None:
    """Run the traced model once; the output shapes it records (``tensor_meta``) tell later passes tensor ranks."""
    try:
        with torch.no_grad():
            gm(*example_inputs)  # plain first: ShapeProp prints its own traceback on failure
            ShapeProp(gm).propagate(*example_inputs)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"the model rejects the example inputs ({_describe(example_inputs)}): {reason}") from exc


def _check_islands(model: nn.Module, gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> None:
    """Run ``gm`` with its INT8 islands in place: a read of a replaced layer's attribute that the island cannot
    answer fails here, at prepare, naming the island, the user's line and the fix. The observers see this run,
    so their state is put back after it: prepare calibrates nothing."""
    try:
        with observers_kept(gm):
            _run_example(gm, example_inputs)
    except InputError as error:
        where = user_location(error.__cause__) if error.__cause__ is not None else "unknown location"
        raise TraceError(f"{type(model).__name__} runs with INT8 islands inside its untraceable blocks, and fails "
                         f"at {where}: {error}") from error


def _rejects(model: nn.Module, example_inputs: tuple[Any, ...]) -> bool:
    """Whether the user's own float model fails on the example inputs (bad inputs, rather than a bad rewrite)."""
    try:
        with torch.no_grad():
            model(*example_inputs)
    except Exception:
        return True
    return False


def prepare(model: nn.Module, example_inputs: Any, config: QuantConfig | None = None, *,
            concrete_args: dict[str, Any] | None = None, tracer_class: type[fx.Tracer] | None = None,
            ) -> fx.GraphModule:
    """Trace a copy of ``model``, fold BatchNorm, fuse activations and insert observers.

    The returned GraphModule computes what ``model`` computes (observers are identities) while recording ranges.
    ``model`` itself is never modified. Submodules torch.fx cannot trace stay float (``config.partial_tracing``;
    ``fxquant.coverage`` lists them); ``concrete_args`` and ``tracer_class`` are passed to torch.fx. Example::

        prepared = fxquant.prepare(model.eval(), (torch.randn(1, 3, 224, 224),))
    """
    _check_model(model)
    config = (config or QuantConfig()).for_model(model)  # scheme="auto" resolved: the recorded config says which
    example_inputs = check_example_inputs(example_inputs)
    options: dict[str, Any] = dict(leaf_modules=config.leaf_modules, concrete_args=concrete_args,
                                   tracer_class=tracer_class)
    wrapped, breaks = False, tuple[GraphBreak, ...]()
    if not config.partial_tracing:
        gm, breaks = trace(copy.deepcopy(model), **options), ()
    else:
        try:
            gm, breaks = trace_partially(copy.deepcopy(model), **options)
        except TraceError as error:  # the root's own forward does not trace: quantize what is inside it
            gm, inner = wrap_untraceable_root(copy.deepcopy(model), config)
            breaks, wrapped = (error.failure, *inner), True
    try:
        _run_example(gm, example_inputs)
    except InputError as error:
        if not wrapped or _rejects(model, example_inputs):
            raise
        where = user_location(error.__cause__) if error.__cause__ is not None else "unknown location"
        raise TraceError(f"{type(model).__name__}'s forward does not trace, and run as written with its layers "
                         f"swapped for INT8 islands it fails at {where}: {error}. If it reads a layer's attributes "
                         "(e.g. `F.linear(x, self.fc.weight)`), exclude that layer, or make the forward traceable "
                         "(partial_tracing=False names the line that is not)") from error
    if not wrapped:
        gm = prepare_graph(gm, config)
        breaks = (*breaks, *prepare_islands(gm, breaks, config))
        if prepared_islands(gm):  # the graph reads through untraceable blocks, whose layers are islands now
            _check_islands(model, gm, example_inputs)
    specs = tuple(InputSpec((), NONE) if v is None else InputSpec(tuple(v.shape), str(v.dtype).removeprefix("torch."))
                  for v in example_inputs if v is None or isinstance(v, torch.Tensor))
    gm.meta[STATE_KEY] = QuantState(config, "prepared", specs, graph_breaks=breaks, wrapped=wrapped,
                                    channels_last=runs_channels_last(gm, example_inputs))
    schemed = [node.meta[LAYER_SETTINGS].scheme for g in (gm, *prepared_islands(gm).values())
               for node in scheme_layers(g)]
    unsmoothed = [scheme for scheme in schemed if scheme != "static_outliers"]  # those observe their inputs
    if not observers_of(gm) and not schemed:  # documented (docs/robustness.md): a no-op, not an error
        log.warning("fxquant: %s has no Linear/Conv layer to quantize (all excluded or untraceable); "
                    "convert() will return it unchanged, in float", type(model).__name__)
    if config.smoothquant_alpha is not None and unsmoothed:
        scheme = next((s for s in unsmoothed if s in FLOAT_IO_SCHEMES), "dynamic_group")  # one convert switches to
        log.warning("fxquant: smoothquant_alpha=%s does not reach the %d Linear(s) on a float-in, float-out scheme "
                    "(%s): they observe nothing at prepare, so they run unsmoothed. For SmoothQuant with such a "
                    "scheme, prepare them static (QuantConfig(scheme='static', smoothquant_alpha=...)), calibrate, "
                    "then switch at convert: convert(prepared, schemes={'*': %r}) (CLI: --scheme '*=%s')",
                    config.smoothquant_alpha, len(unsmoothed), ", ".join(sorted(set(unsmoothed))), scheme, scheme)
    return gm


def _lower(prepared: fx.GraphModule, config: QuantConfig, backend: str) -> fx.GraphModule:
    kernel = get_backend(backend)
    gm = lower_to_int8(prepared, config, kernel)
    lower_islands(gm, kernel)
    for graph in (gm, *(m for m in gm.modules() if m is not gm and isinstance(m, fx.GraphModule))):
        fold_channel_scales(lower_schemes(graph))
    unwrap_layer_islands(gm)
    return gm


def _check_schemes(schemes: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(schemes, Mapping):
        raise ConfigError(f"schemes must map module path patterns to schemes, got {schemes!r}")
    for pattern, scheme in schemes.items():
        if scheme not in FLOAT_IO_SCHEMES:
            raise ConfigError(f"convert(schemes={{{pattern!r}: {scheme!r}}}): convert can switch calibrated layers to "
                              f"{', '.join(map(repr, FLOAT_IO_SCHEMES))} (none needs observers); static W8A8 "
                              "needs calibrated ranges: set QuantConfig(scheme=...) or overrides at prepare instead")
    return dict(schemes)


def apply_statistics(prepared: fx.GraphModule, *, keep_float: Collection[str] = (),
                     schemes: Mapping[str, str] | None = None) -> fx.GraphModule:
    """A copy of calibrated ``prepared`` after the passes that use calibration statistics, still float.

    In order: observers that saw no data removed (their layers stay float, :mod:`fxquant.passes.unobserved`),
    SmoothQuant (``smoothquant_alpha``), the layers matching the ``keep_float`` patterns kept float, the Linears
    matching a ``schemes`` pattern marked for that scheme (the first matching pattern wins), bias correction
    (``bias_correction``); their statistics nodes are removed. This is the float graph ``convert``
    lowers, so ``fxquant.testing.simulate(apply_statistics(prepared))`` is the fake-quant twin of
    ``convert(prepared)``, and its layers are the float references of the INT8 ones at the same paths.
    """
    if isinstance(keep_float, str):
        raise ConfigError(f"keep_float must be a list of module path patterns, got the string {keep_float!r}")
    chosen = _check_schemes(schemes or {})
    gm = copy.deepcopy(prepared)
    recorded = quant_state(gm).smoothquant_alphas  # "auto"'s choices, where a loaded model brought them
    for graph in (gm, *prepared_islands(gm).values()):
        state = quant_state(graph)
        attach_token_ranges(graph, state.prefix)  # first: an empty one keeps its layer float, not just itself gone
        keep_unobserved_float(graph, state.prefix)
        smooth_activations(graph, state.config, recorded)
        keep_layers_float(graph, tuple(keep_float), prefix=state.prefix)
        for pattern, scheme in reversed(chosen.items()):  # applied last to first: the first matching one stays
            keep_layers_float(graph, (pattern,), prefix=state.prefix, scheme=scheme)
        correct_biases(graph)
    return gm


def _check_observed(prepared: fx.GraphModule, config: QuantConfig) -> None:
    # statistics for SmoothQuant and bias correction sit beside the activation observers of the same layers
    observers = [obs for obs in observers_of(prepared).values() if obs.kind == "activation"]
    empty = [obs.label for obs in observers if not obs.has_data]
    if not empty:
        return
    if config.unobserved == "error" or len(empty) == len(observers):
        raise CalibrationError(f"{len(empty)} observer(s) saw no data: {', '.join(empty)}. Run "
                               "fxquant.calibrate(prepared, data) with data that reaches them before convert().")
    layers = [path for graph in (prepared, *prepared_islands(prepared).values())
              for path in unobserved_layers(graph, quant_state(graph).prefix)]
    log.warning("fxquant: %d observer(s) saw no data during calibration (%s): %s stay float. Calibrate with data "
                "that takes that branch to quantize them, or pass QuantConfig(unobserved='error') to refuse.",
                len(empty), ", ".join(empty), ", ".join(layers) or "no layer; the values there")


def convert(prepared: fx.GraphModule, *, backend: str | None = None, keep_float: Collection[str] = (),
            example_inputs: tuple[Any, ...] | None = None, layer_backends: Mapping[str, str] | None = None,
            schemes: Mapping[str, str] | None = None) -> nn.Module:
    """Replace observed Linear/Conv/add nodes with INT8 modules running on ``backend`` (default: the config's).

    ``keep_float`` (fnmatch patterns on module paths, like ``QuantConfig.exclude``) keeps those layers float without
    calibrating again: the accuracy-budget search converts one calibrated model many ways with it. ``schemes`` (pattern
    -> ``"dynamic"``, ``"dynamic_group"`` or ``"weight_only"``, the first matching pattern winning) runs the matching
    Linears on that scheme instead, also without calibrating again: ``schemes={"*down_proj": "weight_only"}``.
    SmoothQuant and bias correction are applied here (see :func:`apply_statistics`). An input embedding tied to a
    head that became INT8 (``tie_word_embeddings``) reads the head's int8 rows instead of keeping a float copy of its
    weight (:mod:`fxquant.passes.tied_embeddings`); a ``keep_float`` pattern matching it keeps it float.

    ``backend="auto"`` measures the available kernels on this CPU on each layer's real shapes (see
    :mod:`fxquant.runtime.auto_backend`); ``fxquant.coverage`` shows the backend each layer got. The fastest kernel
    depends on the
    batch size (fbgemm leads at batch 1, oneDNN at 32 on AMX CPUs), so pass ``example_inputs`` shaped like your
    deployment batches; by default auto measures on random inputs shaped like prepare()'s ``example_inputs``. The
    choices are recorded (``quant_state(qmodel).layer_backends``, and in saved artifacts); ``layer_backends=`` with
    ``backend="auto"`` replays such a record without measuring, so a saved auto model loads as it was. Raises
    ``CalibrationError`` when no observer saw data (calibrate first); layers whose observers saw none (a branch the
    calibration data never took) stay float with a warning, or raise with ``QuantConfig(unobserved="error")``.
    ``prepared`` is left unchanged. Example::

        qmodel = fxquant.convert(prepared, backend="auto", example_inputs=(torch.randn(32, 3, 224, 224),))
    """
    state = quant_state(prepared)
    if state.stage != "prepared":
        raise InputError("convert() takes the model returned by prepare(), not an already converted one")
    _check_observed(prepared, state.config)
    name = backend or state.config.backend
    for option, value in (("example_inputs", example_inputs), ("layer_backends", layer_backends)):
        if value is not None and name != "auto":
            raise InputError(f"convert({option}=...) is for backend='auto'; the backend here is {name!r}. Drop "
                             f"{option}, or pass backend='auto'.")
    final = apply_statistics(prepared, keep_float=keep_float, schemes=schemes)
    tied = tied_heads(prepared)
    column_scales = head_column_scales(final, tied)  # before lowering: what SmoothQuant did to a tied head's weight
    choices: dict[str, str] = {}
    if name != "auto":
        gm = _lower(final, state.config, name)
    elif layer_backends:
        gm, choices = _replay_auto(final, state, dict(layer_backends))
    else:
        gm, choices = _convert_auto(final, state, example_inputs)
    share_tied_embeddings(gm, tied, column_scales, keep_float=keep_float, prefix=f"{WRAPPED}." if state.wrapped else "")
    alphas = smoothquant_alphas(final) if state.config.smoothquant_alpha == AUTO else {}
    statistics = {f"{name}.{key}": value.detach().clone()  # nested island observers too (fxquant.save needs all)
                  for name, obs in observers_of(prepared).items()
                  for key, value in (obs.recorded_state() if alphas and isinstance(obs, ChannelRangeObserver)
                                     else obs.state_dict()).items()}
    gm.meta[STATE_KEY] = replace(state, stage="converted", backend=name, observer_state=statistics,
                                 layer_backends=choices, keep_float=tuple(keep_float), schemes=dict(schemes or {}),
                                 smoothquant_alphas=alphas)
    return attention_for_backend(drop_in(runner.install(gm)), name)


def _replay_auto(final: fx.GraphModule, state: QuantState, choices: dict[str, str]
                 ) -> tuple[fx.GraphModule, dict[str, str]]:
    """``backend="auto"`` with recorded per-layer choices: the same model, without measuring anything."""
    family = family_of(choices)
    if family is None:
        families = " or ".join("/".join(f) for f in FAMILIES)
        raise InputError(f"layer_backends must name backends of one auto family ({families}), got "
                         f"{sorted(set(choices.values()))}")
    gm = _lower(final, state.config, family)
    return gm, relower_layers(gm, choices)


def _convert_auto(final: fx.GraphModule, state: QuantState, example_inputs: Any
                  ) -> tuple[fx.GraphModule, dict[str, str]]:
    """``backend="auto"`` on the user's timing inputs, or on random ones shaped like prepare()'s."""
    def lower(gm: fx.GraphModule, backend: str) -> fx.GraphModule:
        return _lower(gm, state.config, backend)

    if example_inputs is None:
        return convert_auto(final, lower, tuple(spec.make() for spec in state.example_inputs))
    example = check_example_inputs(example_inputs)
    try:
        return convert_auto(final, lower, example)
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        raise InputError(f"convert(backend='auto', example_inputs=...): the model does not run on "
                         f"{_describe(example)} ({type(error).__name__}: {str(error).splitlines()[0]}); pass inputs "
                         "shaped like prepare()'s example_inputs, with your deployment batch size") from None


def recompute_qparams(prepared: fx.GraphModule, *, activation: str, **options: Any) -> fx.GraphModule:
    """Switch every observer of a calibrated ``prepared`` model to another range method, without new data.

    Histogram-family observers (``histogram``, ``percentile``, ``entropy``, ``mse``) share one stored histogram, so
    any of them can become any other; every observer can become ``minmax``. The model is changed in place and
    returned; ``convert`` then uses the new ranges. Example::

        prepared = fxquant.prepare(model, example, QuantConfig(activation="histogram"))
        fxquant.calibrate(prepared, data)
        fxquant.recompute_qparams(prepared, activation="entropy")
        qmodel = fxquant.convert(prepared)
    """
    state = quant_state(prepared)
    for name, observer in observers_of(prepared).items():
        if not isinstance(observer, StatisticsObserver):  # SmoothQuant/bias statistics are not ranges
            replace_submodule(prepared, name, switch_method(observer, activation, **options))
    config = replace(state.config, activation=activation,
                     observer_options={**state.config.observer_options, **options})
    update_state(prepared, config=config)
    return prepared

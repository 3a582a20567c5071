"""Per-layer sensitivity: how much error each INT8 layer adds by itself (isolated SQNR), for the fallback search.

The float reference is :func:`fxquant.api.apply_statistics` of the calibrated prepared model, not the user's float
model: after cross-layer equalization and SmoothQuant the INT8 layer at path ``P`` computes a rescaled version of the
user's layer, and only the equalized/smoothed float graph has the same layer at ``P``. Each reference layer's input
is recorded with a forward hook (hooks reach layers inside INT8 islands too), the INT8 layer is run on that same
input (quantized with its input qparams; a dynamic or weight-only Linear reads it as float), and the two outputs are
compared over all batches.

This overlaps with ``fxquant.report``'s per-layer capture, which compares against the user's float model; the two
can merge once the report's reference applies the same prepare passes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from fxquant.api import apply_statistics
from fxquant.calibration.adapters import forward_parameters, to_call_args
from fxquant.nn.fused import Fused, compute_module
from fxquant.nn.schemes import SchemeLinear
from fxquant.passes.islands import prepared_islands
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.report.layers import QuantizedLayer
from fxquant.report.metrics import energy_ratio_db
from fxquant.state import quant_state


def quantized_layer_paths(prepared: fx.GraphModule) -> dict[str, str]:
    """Config path (what ``exclude`` patterns name) -> module path in ``prepared`` of every layer to be quantized:
    static W8A8, or on a float-in, float-out scheme (``QuantConfig(scheme=...)``).

    They differ for layers inside INT8 islands, whose graphs keep the layer under the island's own module names.
    """
    graphs: dict[str, fx.GraphModule] = {"": prepared, **prepared_islands(prepared)}
    paths = {}
    for where, graph in graphs.items():
        prefix = quant_state(graph).prefix
        for node in graph.graph.nodes:
            settings = node.meta.get(LAYER_SETTINGS)
            if settings is not None and (settings.quantize or settings.scheme != "static"):
                paths[prefix + str(node.target)] = f"{where}.{node.target}" if where else str(node.target)
    return paths


class Int8Layer(NamedTuple):
    """An INT8 layer of a converted model: where it is, the module, and its scheme."""

    module_path: str  # in the converted model: the island's path where convert put the bare layer in its place
    module: nn.Module
    scheme: str  # "static", or the float-in, float-out scheme of a dynamic / weight-only Linear
    linear: bool  # a Linear (what the float-in, float-out schemes apply to), not a convolution


def _scheme_linear(module: nn.Module) -> SchemeLinear | None:
    inner = module.inner if isinstance(module, Fused) else module
    return inner if isinstance(inner, SchemeLinear) else None


def _int8_module(quantized: nn.Module, module_path: str) -> tuple[str, nn.Module] | None:
    """The INT8 module of the layer at ``module_path`` of the prepared model, or None (the layer stayed float).

    A one-layer island whose layer became a dynamic or weight-only Linear is replaced by that layer, bare, at the
    island's own path (:func:`fxquant.passes.schemes.unwrap_layer_islands`), so the parent path is tried too."""
    for path in (module_path, module_path.rpartition(".")[0]):
        try:
            module = quantized.get_submodule(path) if path else None
        except AttributeError:
            continue
        if module is not None and (_scheme_linear(module) is not None or isinstance(module, QuantizedLayer)):
            return path, module
    return None


def int8_layers(prepared: fx.GraphModule, quantized: nn.Module) -> dict[str, Int8Layer]:
    """Config path -> :class:`Int8Layer` of every layer ``quantized`` (converted from ``prepared``) runs INT8."""
    layers = {}
    for config, module_path in quantized_layer_paths(prepared).items():
        found = _int8_module(quantized, module_path)
        if found is None:
            continue
        scheme = _scheme_linear(found[1])
        linear = scheme is not None or isinstance(compute_module(prepared.get_submodule(module_path)), nn.Linear)
        layers[config] = Int8Layer(*found, "static" if scheme is None else scheme.scheme, linear)
    return layers


def _isolated(module: nn.Module, float_input: torch.Tensor) -> torch.Tensor:
    """The INT8 layer's float output for the reference input (the reference layer's input, in the smoothed
    coordinates of :func:`~fxquant.api.apply_statistics`)."""
    scheme = _scheme_linear(module)
    if scheme is not None:  # float in; a bare layer that took over SmoothQuant's scale applies it itself
        unscaled = float_input if scheme.input_scale is None else float_input / scheme.input_scale
        return module(unscaled).float()
    assert isinstance(module, QuantizedLayer)
    return module.backend.dequantize(module(module.backend.quantize(float_input, module.in_qp)), module.out_qp).float()


class _Recorder:
    """Forward hooks on the reference layers: each call's (input, output) of the current batch."""

    def __init__(self, reference: nn.Module, module_paths: Iterable[str]) -> None:
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = [reference.get_submodule(path).register_forward_hook(self._hook(path)) for path in module_paths]

    def _hook(self, path: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                self.seen[path] = (args[0].detach(), output.detach().float())

        return record

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.inference_mode()
def layer_sqnr(prepared: fx.GraphModule, quantized: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
    """Isolated SQNR in dB of every INT8 layer of ``quantized`` (converted from ``prepared``), lowest first.

    ``batches`` are raw batches of the calibration data (tensors, tuples or dicts). Keys are config paths.
    """
    reference = apply_statistics(prepared)
    layers = int8_layers(prepared, quantized)
    paths = quantized_layer_paths(prepared)
    energies = {config: [0.0, 0.0] for config in layers}
    recorder = _Recorder(reference, [paths[config] for config in layers])
    names, _ = forward_parameters(reference)
    try:
        for batch in batches:
            args, kwargs = to_call_args(batch, names)
            recorder.seen.clear()
            reference(*args, **kwargs)
            for config, layer in layers.items():
                if paths[config] not in recorder.seen:
                    continue
                float_in, float_out = recorder.seen[paths[config]]
                approx = _isolated(layer.module, float_in)
                energies[config][0] += float(float_out.double().pow(2).sum())
                energies[config][1] += float((float_out.double() - approx.double()).pow(2).sum())
    finally:
        recorder.close()
    result = {config: energy_ratio_db(signal, noise) for config, (signal, noise) in energies.items() if signal > 0}
    return dict(sorted(result.items(), key=lambda item: item[1]))

"""Per-layer sensitivity: how much error each INT8 layer adds by itself (isolated SQNR), for the fallback search.

The float reference is :func:`fxquant.api.apply_statistics` of the calibrated prepared model, not the user's float
model: after cross-layer equalization and SmoothQuant the INT8 layer at path ``P`` computes a rescaled version of the
user's layer, and only the equalized/smoothed float graph has the same layer at ``P``. Each reference layer's input
is recorded with a forward hook (hooks reach layers inside INT8 islands too), the INT8 layer is run on that same
input (quantized with its input qparams), and the two outputs are compared over all batches.

This overlaps with ``fxquant.report``'s per-layer capture, which compares against the user's float model; the two
can merge once the report's reference applies the same prepare passes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn

from fxquant.api import apply_statistics
from fxquant.calibration.adapters import forward_parameters, to_call_args
from fxquant.passes.islands import prepared_islands
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.report.metrics import energy_ratio_db
from fxquant.state import quant_state


def quantized_layer_paths(prepared: fx.GraphModule) -> dict[str, str]:
    """Config path (what ``exclude`` patterns name) -> module path in ``prepared`` of every layer to be quantized.

    They differ for layers inside INT8 islands, whose graphs keep the layer under the island's own module names.
    """
    graphs: dict[str, fx.GraphModule] = {"": prepared, **prepared_islands(prepared)}
    paths = {}
    for where, graph in graphs.items():
        prefix = quant_state(graph).prefix
        for node in graph.graph.nodes:
            settings = node.meta.get(LAYER_SETTINGS)
            if settings is not None and settings.quantize:
                paths[prefix + str(node.target)] = f"{where}.{node.target}" if where else str(node.target)
    return paths


def _isolated(module: nn.Module, float_input: torch.Tensor) -> torch.Tensor | None:
    """The INT8 layer's float output for the reference input, or None when ``module`` is not an INT8 layer."""
    backend, in_qp, out_qp = (getattr(module, name, None) for name in ("backend", "in_qp", "out_qp"))
    if backend is None or in_qp is None or out_qp is None:
        return None
    return backend.dequantize(module(backend.quantize(float_input, in_qp)), out_qp).float()


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
def layer_sqnr(prepared: fx.GraphModule, quantized: fx.GraphModule, batches: Iterable[Any]) -> dict[str, float]:
    """Isolated SQNR in dB of every INT8 layer of ``quantized`` (converted from ``prepared``), lowest first.

    ``batches`` are raw batches of the calibration data (tensors, tuples or dicts). Keys are config paths.
    """
    reference = apply_statistics(prepared)
    paths = {config: module for config, module in quantized_layer_paths(prepared).items()
             if _isolated_layer(quantized, module)}
    energies = {config: [0.0, 0.0] for config in paths}
    recorder = _Recorder(reference, paths.values())
    names, _ = forward_parameters(reference)
    try:
        for batch in batches:
            args, kwargs = to_call_args(batch, names)
            recorder.seen.clear()
            reference(*args, **kwargs)
            for config, module_path in paths.items():
                if module_path not in recorder.seen:
                    continue
                float_in, float_out = recorder.seen[module_path]
                approx = _isolated(quantized.get_submodule(module_path), float_in)
                assert approx is not None
                energies[config][0] += float(float_out.double().pow(2).sum())
                energies[config][1] += float((float_out.double() - approx.double()).pow(2).sum())
    finally:
        recorder.close()
    result = {config: energy_ratio_db(signal, noise) for config, (signal, noise) in energies.items() if signal > 0}
    return dict(sorted(result.items(), key=lambda item: item[1]))


def _isolated_layer(quantized: nn.Module, module_path: str) -> bool:
    try:
        module = quantized.get_submodule(module_path)
    except AttributeError:
        return False
    return all(hasattr(module, name) for name in ("backend", "in_qp", "out_qp"))

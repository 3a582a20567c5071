"""Per-layer error: every float Linear/Conv's output in the quantized model against the float model.

Outputs are captured by :class:`CaptureInterpreter` (an ``fx.Interpreter`` that records call_module results by
module path) on two graphs run on the same batch: the converted model, and a float reference traced with fxquant's
own pipeline minus the observers (trace, functional calls to modules, fold BatchNorm, fuse activations). In both
graphs the module at path ``P`` then computes the same thing (conv + bn + activation), so outputs compare one to one
although BN was folded away.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import fx, nn

from fxquant.calibration.adapters import forward_parameters
from fxquant.kernels.base import Backend
from fxquant.nn.fused import COMPUTE_TYPES, Fused, compute_module
from fxquant.nn.schemes import SchemeLinear
from fxquant.passes import fold_batchnorm, functional_to_modules, fuse_activations
from fxquant.qparams import QParams, sqnr_db
from fxquant.report.layer_stats import LayerStats, histogram
from fxquant.report.sections import LayerReport
from fxquant.state import QuantState
from fxquant.tracing import trace

Captured = dict[str, tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class QuantizedLayer(Protocol):
    """What the report needs of an INT8 Linear/Conv/ConvTranspose (``fxquant.nn.quantized``), whichever its type."""

    backend: Backend
    in_qp: QParams
    out_qp: QParams

    def __call__(self, a: torch.Tensor) -> torch.Tensor: ...

    def dequantized_weight(self) -> torch.Tensor: ...


class CaptureInterpreter(fx.Interpreter):
    """Runs a GraphModule and records ``(input, output)`` of the call_module nodes whose target is in ``paths``.

    With ``dequantize=True`` an int8 output of a quantized layer is recorded in float (through its backend and
    output qparams), so it can be compared with the float reference.
    """

    def __init__(self, gm: fx.GraphModule, paths: Sequence[str], *, dequantize: bool = False) -> None:
        super().__init__(gm)
        self.paths = frozenset(paths)
        self.dequantize = dequantize
        self.captured: Captured = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op == "call_module" and str(n.target) in self.paths:
            module = self.module.get_submodule(str(n.target))
            args, _ = self.fetch_args_kwargs_from_env(n)
            output = result
            if self.dequantize and isinstance(module, QuantizedLayer):
                output = module.backend.dequantize(result, module.out_qp)
            self.captured[str(n.target)] = (args[0], output.detach().float())
        return result


def float_reference(float_model: nn.Module, leaf_modules: Sequence[str]) -> fx.GraphModule:
    """The float model traced by fxquant's pipeline without observers: fused/folded layers sit at their paths."""
    gm = trace(copy.deepcopy(float_model), leaf_modules=leaf_modules)
    return fuse_activations(fold_batchnorm(functional_to_modules(gm)))  # as fxquant.prepare, minus observers


def layer_paths(float_model: nn.Module, reference: fx.GraphModule | None = None) -> list[str]:
    """Paths of every Linear/Conv of the float model (definition order), then of the layers that only exist in the
    reference graph (``F.linear``/``F.conv`` calls the pipeline turned into modules), in graph order."""
    paths = [path for path, module in float_model.named_modules() if isinstance(module, COMPUTE_TYPES)]
    if reference is not None:
        modules = dict(reference.named_modules())
        called = [str(n.target) for n in reference.graph.nodes if n.op == "call_module"]
        paths += [p for p in dict.fromkeys(called) if p not in paths and compute_module(modules[p]) is not None]
    return paths


def _called_paths(gm: fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}


def float_reason(path: str, state: QuantState, called: set[str]) -> str:
    """Why the layer at ``path`` stayed float."""
    settings = state.config.settings_for(path)
    if not settings.quantize:
        return settings.reason
    if path not in called:
        leaf = next((p for p in called if path.startswith(p + ".")), None)
        return f"inside leaf module {leaf!r} (runs as a float black box)" if leaf else "not called by the forward"
    return "left float by convert (its input is not a quantizable tensor)"


def _positional(gm: fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Interpreter.run takes positional inputs only: place keyword inputs at their parameter's position."""
    names, _ = forward_parameters(gm)
    values = list(args)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for name, node in zip(names[len(args):], placeholders[len(args):], strict=True):
        if name not in kwargs and not node.args:
            break
        values.append(kwargs.get(name, node.args[0] if node.args else None))
    return values


def _isolated_output(module: QuantizedLayer, float_input: torch.Tensor) -> torch.Tensor:
    """The quantized layer run on its float reference input: the error this layer adds by itself."""
    backend = module.backend
    return backend.dequantize(module(backend.quantize(float_input, module.in_qp)), module.out_qp).float()


def _quant_range(qp: QParams) -> tuple[float, float]:
    scale, zero_point = qp.scalar()
    return (qp.qmin - zero_point) * scale, (qp.qmax - zero_point) * scale


class LayerProbe:
    """Per-layer statistics of a converted model against its float reference, accumulated batch by batch."""

    def __init__(self, float_model: nn.Module, quantized: fx.GraphModule, state: QuantState) -> None:
        self.quantized = quantized
        self.state = state
        self.reference = float_reference(float_model, state.config.leaf_modules)
        self.paths = layer_paths(float_model, self.reference)
        self.called = _called_paths(quantized)
        self.stats = {path: LayerStats() for path in self.paths}

    @torch.inference_mode()
    def observe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run one batch through both graphs and fold each layer's outputs into its statistics."""
        inputs = _positional(self.reference, args, kwargs)
        reference = CaptureInterpreter(self.reference, self.paths)
        reference.run(*inputs)
        quantized = CaptureInterpreter(self.quantized, self.paths, dequantize=True)
        quantized.run(*inputs)
        for path, (float_in, float_out) in reference.captured.items():
            if path not in quantized.captured:
                continue
            module = self.quantized.get_submodule(path)
            isolated = _isolated_output(module, float_in) if isinstance(module, QuantizedLayer) else \
                module(float_in).float() if _scheme_layer(module) is not None else None  # float in: as it is
            self.stats[path].update(float_out, quantized.captured[path][1], isolated)

    def results(self) -> list[LayerReport]:
        return [self._layer_report(path) for path in self.paths]

    def _layer_report(self, path: str) -> LayerReport:
        stats = self.stats[path]
        module = _submodule(self.quantized, path)
        layer = compute_module(_submodule(self.reference, path) or nn.Module())  # BatchNorm folded in
        weight = None if layer is None else layer.weight.detach().float()
        common: dict[str, Any] = dict(
            kind=type(layer).__name__ if layer is not None else "", sqnr_db=stats.sqnr_db(),
            activation_range=stats.range(), activation_histogram=stats.histogram(),
            weight_range=None if weight is None else (float(weight.min()), float(weight.max())),
            weight_histogram=None if weight is None else histogram(weight),
        )
        scheme = _scheme_layer(module)
        if scheme is not None:  # dynamic or weight-only: float in and out, no output range
            return LayerReport(path, True, backend=f"{scheme.kernel} ({scheme.scheme})",
                               isolated_sqnr_db=stats.isolated_sqnr_db(),
                               weight_sqnr_db=None if weight is None else sqnr_db(weight, scheme.dequantized_weight()),
                               **common)
        if not isinstance(module, QuantizedLayer):
            return LayerReport(path, False, reason=float_reason(path, self.state, self.called), backend="float",
                               **common)
        weight_sqnr = None if weight is None else sqnr_db(weight, module.dequantized_weight())
        return LayerReport(path, True, backend=module.backend.name, isolated_sqnr_db=stats.isolated_sqnr_db(),
                           weight_sqnr_db=weight_sqnr, quant_range=_quant_range(module.out_qp), **common)


def _scheme_layer(module: nn.Module | None) -> SchemeLinear | None:
    """The dynamic or weight-only INT8 Linear ``module`` is (plain or inside a fused activation), else None."""
    inner = module.inner if isinstance(module, Fused) else module
    return inner if isinstance(inner, SchemeLinear) else None


def _submodule(gm: fx.GraphModule, path: str) -> nn.Module | None:
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None

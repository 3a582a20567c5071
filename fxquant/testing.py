"""Reference computations that INT8 models are checked against (shipped so that users' backends can be too).

``simulate(prepared, backend)`` is the float fake-quant model of a calibrated prepared graph: every observer becomes
a quantize-dequantize with the qparams convert would use on ``backend``, every quantized Linear/Conv computes with
its fake-quantized weight. A correct INT8 model matches it to within rounding of each quantized value.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from fxquant.api import quant_state
from fxquant.kernels.registry import get_backend
from fxquant.nn.fused import compute_module
from fxquant.passes._graph import replace_submodule
from fxquant.passes.lower import observer_qparams, weight_qparams
from fxquant.qparams import QParams, fake_quantize


class FakeQuantize(nn.Module):
    """Quantize-dequantize in float with fixed qparams."""

    def __init__(self, qp: QParams) -> None:
        super().__init__()
        self.qp = qp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize(x, self.qp)


@torch.no_grad()
def simulate(prepared: fx.GraphModule, backend: str | None = None) -> fx.GraphModule:
    """The fake-quant float model equivalent to ``convert(prepared, backend=backend)``."""
    state = quant_state(prepared)
    kernel = get_backend(backend or state.config.backend)
    gm = copy.deepcopy(prepared)
    for name, qp in observer_qparams(gm, kernel).items():
        replace_submodule(gm, name, FakeQuantize(qp))
    observed = {str(n.args[0].target) for n in gm.graph.nodes
                if n.op == "call_module" and str(n.target) in observer_qparams(prepared, kernel)
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "call_module"}
    for path, module in list(gm.named_modules()):
        layer = compute_module(module)
        if layer is not None and path in observed:
            layer.weight.copy_(fake_quantize(layer.weight, weight_qparams(state.config, path, layer)))
    gm.recompile()
    return gm


def assert_sqnr(reference: torch.Tensor, actual: torch.Tensor, floor_db: float, what: str = "output") -> float:
    """Assert ``actual`` is within ``floor_db`` SQNR of ``reference``; the message carries the measured dB."""
    from fxquant.qparams import sqnr_db

    measured = sqnr_db(reference, actual)
    assert measured >= floor_db, f"{what}: SQNR {measured:.2f} dB is below the floor of {floor_db} dB"
    return measured

"""Reference computations that INT8 models are checked against (shipped so that users' backends can be too).

``simulate(prepared, backend)`` is the float fake-quant model of a calibrated prepared graph: every observer becomes
a quantize-dequantize with the qparams convert would use on ``backend``, every quantized Linear/Conv computes with
its fake-quantized weight, every average pool of an int8 value rounds its output to the input's grid (as the INT8
kernels do), every sigmoid/hardsigmoid/tanh of an int8 value is fake-quantized to its fixed output qparams, and
the output of a layer that convert lets return float (``fuses_float_output``) is not rounded. A residual add that
stays float (``passes.float_outputs``) has no observer, so it is float here too. A correct INT8 model matches it to
within rounding of each quantized value.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from fxquant.api import quant_state
from fxquant.kernels.base import Backend
from fxquant.kernels.registry import get_backend
from fxquant.nn.fused import compute_module
from fxquant.passes._graph import modules_of, only_user, replace_submodule
from fxquant.passes.lower import fixed_output_qparams, observer_qparams, weight_qparams
from fxquant.passes.meta import LAYER_SETTINGS
from fxquant.passes.patterns import OpKind, classify, tensor_input
from fxquant.passes.value_ops import pool_options
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
    """The fake-quant float model equivalent to ``convert(prepared, backend=backend)``: of
    :func:`fxquant.api.apply_statistics` (SmoothQuant, bias correction, ... as convert applies them)."""
    from fxquant.api import apply_statistics  # lazy: the API sits above the testing helpers

    kernel = get_backend(backend or quant_state(prepared).config.backend)
    gm = apply_statistics(prepared)
    activation_qparams = observer_qparams(gm, kernel)
    for node in gm.graph.nodes:
        user = only_user(node)
        settings = node.meta.get(LAYER_SETTINGS)
        if settings is not None and user is not None and str(user.target) in activation_qparams:
            layer = compute_module(gm.get_submodule(str(node.target)))
            assert layer is not None
            layer.weight.copy_(fake_quantize(layer.weight, weight_qparams(settings, layer)))
    _int8_values_on_the_grid(gm, activation_qparams, kernel)
    unrounded = _unrounded_observers(prepared, kernel)
    for name, qp in activation_qparams.items():
        replace_submodule(gm, name, nn.Identity() if name in unrounded else FakeQuantize(qp))
    gm.recompile()
    return gm


def _unrounded_observers(prepared: fx.GraphModule, kernel: Backend) -> set[str]:
    """The observers of layer outputs that convert fuses away (``Backend.fuses_conv_add``: a conv summed into the
    add after it; ``fuses_float_output``: a Linear/Conv read as float, e.g. by a residual add that stays float, see
    ``passes.float_outputs``): the INT8 model never rounds those values, so neither does the simulation."""
    if not (kernel.fuses_conv_add or kernel.fuses_float_output):
        return set()
    from fxquant.api import convert
    from fxquant.nn.quantized import QuantizedConvAdd2d

    converted = convert(prepared, backend=kernel.name)
    fused = {path for path, m in converted.named_modules()
             if isinstance(m, QuantizedConvAdd2d) or getattr(m, "float_output", False) or getattr(m, "unary", None)}
    observers = (only_user(n) for n in prepared.graph.nodes if n.op == "call_module" and str(n.target) in fused)
    return {str(observer.target) for observer in observers if observer is not None}


class _Centered(nn.Module):
    """Grid values -> ``q - zero_point`` as float64 integers, which an average pool sums exactly."""

    def __init__(self, qp: QParams) -> None:
        super().__init__()
        self.qp = qp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x.double() / float(self.qp.scale))


class _Requantized(nn.Module):
    """A pooled mean of centered integers -> its grid value, rounded half to even as the backend's kernels do
    (``Backend.pool_rounds_stored_integers``)."""

    def __init__(self, qp: QParams, stored: bool) -> None:
        super().__init__()
        self.qp, self.stored = qp, stored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zero_point = int(self.qp.zero_point)
        q = torch.round(x + zero_point) - zero_point if self.stored else torch.round(x)
        q = torch.clamp(q, self.qp.qmin - zero_point, self.qp.qmax - zero_point)
        return (q * float(self.qp.scale)).float()


def _int8_values_on_the_grid(gm: fx.GraphModule, activation_qparams: dict[str, QParams], kernel: Backend) -> None:
    """Follow int8 values from observers through ReLU, pools and reshapes (as ``lower_to_int8`` does); run each
    average pool of one on the integers, and fake-quantize each sigmoid/tanh of one to its fixed qparams.

    An average pool's INT8 output keeps the input's qparams, so the mean is rounded to that grid. Pooling the float
    values instead rounds exact ties (a quarter of 2x2 means) by float error, one step off the kernels, which is
    most of the signal where values span a few steps."""
    modules = modules_of(gm)
    qparams: dict[fx.Node, QParams] = {}
    for node in list(gm.graph.nodes):
        source, kind = tensor_input(node), classify(node, modules)
        if node.op == "call_module" and str(node.target) in activation_qparams:
            qparams[node] = activation_qparams[str(node.target)]
        elif source in qparams and kind is OpKind.FIXED:
            qp = fixed_output_qparams(node, modules, kernel)
            qparams[_wrap(gm, node, None, FakeQuantize(qp))] = qp
        elif source in qparams and kind in (OpKind.VALUE, OpKind.STRUCTURAL):
            qp = qparams[node] = qparams[source]
            pool = pool_options(node, modules) if kind is OpKind.VALUE else None
            if pool is not None and pool[0] != "max":
                rounded = _wrap(gm, node, _Centered(qp), _Requantized(qp, kernel.pool_rounds_stored_integers))
                qparams[rounded] = qp  # what reads the pool reads this node now


def _wrap(gm: fx.GraphModule, node: fx.Node, before: nn.Module | None, after: nn.Module) -> fx.Node:
    """Put ``before`` on ``node``'s tensor input and ``after`` on its output; returns the ``after`` node."""
    if before is not None:
        source = tensor_input(node)
        assert source is not None
        gm.add_submodule(f"centered_{node.name}", before)
        with gm.graph.inserting_before(node):
            centered = gm.graph.call_module(f"centered_{node.name}", (source,))
        node.replace_input_with(source, centered)
    gm.add_submodule(f"requantized_{node.name}", after)
    with gm.graph.inserting_after(node):
        wrapped = gm.graph.call_module(f"requantized_{node.name}", (node,))
    node.replace_all_uses_with(wrapped, delete_user_cb=lambda user: user is not wrapped)
    return wrapped


def assert_sqnr(reference: torch.Tensor, actual: torch.Tensor, floor_db: float, what: str = "output") -> float:
    """Assert ``actual`` is within ``floor_db`` SQNR of ``reference``; the message carries the measured dB."""
    from fxquant.qparams import sqnr_db

    measured = sqnr_db(reference, actual)
    assert measured >= floor_db, f"{what}: SQNR {measured:.2f} dB is below the floor of {floor_db} dB"
    return measured


SEVEN_BIT_DB = 6.0  # one bit fewer doubles the quantization step: 20 * log10(2) = 6.02 dB less SQNR


def seven_bit_margin_db(backend: str) -> float:
    """How far below its 8-bit SQNR floor a model on ``backend`` may land on this CPU: :data:`SEVEN_BIT_DB` where
    the backend quantizes activations to 7 bits (fbgemm and oneDNN without VNNI), else 0."""
    from fxquant.kernels.registry import get_backend

    return SEVEN_BIT_DB if get_backend(backend).activation_qrange(feeds_grouped_conv=False)[1] < 255 else 0.0


def calibrated(model: nn.Module, shape: tuple[int, ...], config: object = None, batches: int = 4) -> fx.GraphModule:
    """A prepared and calibrated copy of ``model`` on ``batches`` random batches of ``shape``."""
    from fxquant.api import prepare
    from fxquant.calibration import calibrate

    data = [torch.randn(*shape) for _ in range(batches)]
    prepared = prepare(model, (data[0],), config)  # type: ignore[arg-type]
    calibrate(prepared, data, progress=False)
    return prepared


def quantized_dtype_backends() -> list[str]:
    """The available backends that run on torch's quantized dtypes (fbgemm, qnnpack)."""
    from fxquant.kernels.registry import available_backends

    return [b for b in ("fbgemm", "qnnpack") if b in available_backends()]


def relowered(qmodel: nn.Module, backend: str) -> nn.Module:
    """A copy of converted ``qmodel`` with every INT8 module on ``backend``: the same qparams, another backend's
    arithmetic (what an export computes: the ``.pt2`` runs the reference backend on the model's own qparams), and
    the attention ``convert`` gives that backend (:func:`fxquant.runtime.hf_attention.attention_for_backend`)."""
    from fxquant.nn.quantized import _BackendModule
    from fxquant.runtime.hf_attention import attention_for_backend
    from fxquant.state import drop_in, graph_of

    twin = copy.deepcopy(graph_of(qmodel))  # a drop-in model: the GraphModule behind it, then its drop-in again
    for module in twin.modules():
        if isinstance(module, _BackendModule):
            module.relower(get_backend(backend))
    return attention_for_backend(drop_in(twin), backend)

"""``format="onnx"``: a QDQ ONNX model that ONNX Runtime runs on its INT8 kernels.

A copy of the converted model is re-lowered onto :class:`~fxquant.artifacts.export.qdq.QdqBackend` and recorded
with ``torch.export``; ``torch.onnx.export`` (the dynamo exporter, with onnxscript) translates its aten ops and
the two QDQ ops, which map one to one onto ONNX's QuantizeLinear and DequantizeLinear (opset 21: per-axis int8
weights, uint8 activations, int32 biases). Which ops ONNX Runtime then fuses into INT8 kernels is checked by
``tests/artifacts/test_export_onnx.py`` with ORT's profiler and measured by ``scripts/bench_export.py``.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import torch
from torch import fx

from fxquant.artifacts.export.lowered import quiet, relowered_copy, trace
from fxquant.artifacts.export.qdq import QdqBackend
from fxquant.errors import ArtifactError
from fxquant.nn.schemes import SchemeLinear

OPSET = 21  # QuantizeLinear/DequantizeLinear with per-axis scales and int32 inputs, all in ONNX Runtime >= 1.17


def _translations() -> dict[Any, Any]:
    from onnxscript import opset21 as op

    def quantize_linear(x: Any, scale: Any, zero_point: Any) -> Any:
        return op.QuantizeLinear(x, scale, zero_point)

    def dequantize_linear(q: Any, scale: Any, zero_point: Any, axis: int) -> Any:
        return op.DequantizeLinear(q, scale, zero_point, axis=axis)

    def conv_integer(x: Any, x_zero_point: Any, w: Any, stride: list[int], padding: list[int], dilation: list[int],
                     groups: int) -> Any:
        return op.ConvInteger(x, w, x_zero_point, strides=stride, pads=[*padding, *padding], dilations=dilation,
                              group=groups)

    ops = torch.ops.fxquant_qdq
    return {ops.quantize_linear.default: quantize_linear, ops.dequantize_linear.default: dequantize_linear,
            ops.conv_integer.default: conv_integer}


def _require_packages() -> None:
    missing = []
    for package in ("onnx", "onnxscript"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise ArtifactError(f"ONNX export needs {' and '.join(missing)}: pip install 'fxquant[onnx]'")


def _root_cause(exc: BaseException) -> str:
    """The innermost error's first line, and the model source line it came from (torch.onnx wraps the error that
    names the op in two layers of generic ones)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    where = [line for line in lines if line.startswith("File ")]
    first = lines[0] if lines else type(exc).__name__
    return f"{type(exc).__name__}: {first[:200]}" + (f" ({where[-1][:200]})" if where else "")


def keep_add_and_layer_norm_apart(graph: Any) -> int:
    """Run each LayerNormalization that reads an Add on a 2-d view of it (``Reshape`` to ``(-1, H)`` and back), so
    that ONNX Runtime does not fuse the pair into SkipLayerNormalization; returns how many were rewritten.

    Why: a transformer's residual stream is float between fxquant's INT8 Linears (their float output feeds the add
    unrounded), and ORT 1.32's CPU SkipLayerNormalization is a scalar loop, much slower than the Add and
    LayerNormalization it replaces (docs/benchmarks.md, "Exported ONNX in ONNX Runtime"; ``scripts/bench_export.py
    --profile``). The views cost two Reshapes and a Shape per norm; the numbers are the unfused ones.
    """
    from onnx import helper, numpy_helper

    producers = {output: node for node in graph.node for output in node.output}
    widths = {init.name: tuple(init.dims) for init in graph.initializer}
    nodes, rewritten = [], 0
    for node in graph.node:
        source = producers.get(node.input[0]) if node.input else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        width = widths.get(node.input[1]) if len(node.input) > 1 else None
        if (node.op_type != "LayerNormalization" or source is None or source.op_type != "Add" or axis != -1
                or width is None or len(width) != 1 or len(node.output) != 1):
            nodes.append(node)
            continue
        name, x, out = f"fxquant_rows_{rewritten}", node.input[0], node.output[0]
        graph.initializer.append(numpy_helper.from_array(np.array([-1, width[0]], dtype=np.int64), f"{name}_shape"))
        nodes.append(helper.make_node("Reshape", [x, f"{name}_shape"], [f"{name}_in"], name=f"{name}_flat"))
        nodes.append(helper.make_node("Shape", [x], [f"{name}_size"], name=f"{name}_size"))
        del node.input[0]
        node.input.insert(0, f"{name}_in")
        node.output[0] = f"{name}_out"
        nodes.append(node)
        nodes.append(helper.make_node("Reshape", [f"{name}_out", f"{name}_size"], [out], name=f"{name}_back"))
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return rewritten


def write_onnx(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> tuple[bytes, torch.export.ExportedProgram]:
    """The ONNX bytes of converted ``gm`` and the ExportedProgram they were translated from. A layer on a float-in,
    float-out scheme is refused: QDQ has no form of its run-time int8 activations, and its float arithmetic written
    as ONNX ops would run as float, not INT8."""
    _require_packages()
    import onnx

    scheme_layer = next(((path, m) for path, m in gm.named_modules() if isinstance(m, SchemeLinear)), None)
    if scheme_layer is not None:
        path, layer = scheme_layer
        raise ArtifactError(f"{path} runs the {layer.scheme!r} scheme, which ONNX's QDQ form (int8 tensors with "
                            "static scales) cannot express; the .pt2 format (format='export') takes it, or quantize "
                            "with QuantConfig(scheme='static') for a QDQ ONNX file")

    program = trace(relowered_copy(gm, QdqBackend()), example_inputs)
    try:
        with quiet(), contextlib.redirect_stdout(io.StringIO()):  # the optimizer prints each initializer it merges
            onnx_program = torch.onnx.export(program, dynamo=True, opset_version=OPSET, verbose=False,
                                             custom_translation_table=_translations(), external_data=False)
    except Exception as exc:
        raise ArtifactError(f"torch.onnx cannot express this model: {_root_cause(exc)}; the .pt2 format "
                            "(format='export') takes it") from None
    assert onnx_program is not None
    proto = onnx_program.model_proto
    keep_add_and_layer_norm_apart(proto.graph)
    onnx.checker.check_model(proto)
    return proto.SerializeToString(), program

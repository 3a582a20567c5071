"""ONNX Runtime static INT8: the float model exported to ONNX, QDQ-quantized (u8 activations, s8 per-channel weights).

``torch.onnx.export`` (the TorchScript exporter, ``dynamo=False``, when ``onnxscript`` is missing: the dynamo exporter
needs it) with a dynamic batch axis -> ``onnxruntime.quantization.quantize_static`` fed the shared calibration batches
-> one ``InferenceSession`` per thread count (``intra_op_num_threads`` is fixed when a session is created), picked
by ``torch.get_num_threads()`` at call time so the benchmark's thread setting applies to it too. ORT's recommended
``quant_pre_process`` (symbolic shape inference, graph optimisation, ONNX shape inference) runs on the float model
first, without the symbolic step where that fails, and not at all where both fail; the candidate's note says which.
The TorchScript exporter records the branch that the example input takes through data-dependent control flow.
"""

from __future__ import annotations

import importlib.util
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _bench_common import Candidate, Peer, Workload, register_peer


def _export_onnx(workload: Workload, path: Path) -> list[str]:
    names = [f"input{i}" for i in range(len(workload.example))]
    dynamo = importlib.util.find_spec("onnxscript") is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(workload.model, workload.example, str(path), input_names=names, output_names=["output"],
                          dynamic_axes={name: {0: "batch"} for name in names}, dynamo=dynamo)
    return names


def _quantize(workload: Workload, names: list[str], float_path: Path, int8_path: Path) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{n: x.numpy() for n, x in zip(names, batch, strict=True)}
                                 for batch in workload.calibration])

        def get_next(self) -> dict[str, Any] | None:
            return next(self.batches, None)

    quantize_static(str(float_path), str(int8_path), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True)


def _pre_process(float_path: Path, out_path: Path) -> tuple[Path, str]:
    """``quant_pre_process`` of the float model: the model to quantize, and a note when a step failed.

    Symbolic shape inference rejects some graphs (the BERT-style encoder's reshapes); ORT's documented remedy is
    ``skip_symbolic_shape=True``, which keeps the graph optimisation and ONNX's own shape inference.
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    failures = []
    for skip_symbolic in (False, True):
        try:
            quant_pre_process(str(float_path), str(out_path), skip_symbolic_shape=skip_symbolic)
        except Exception as exc:
            failures.append(f"{'without' if skip_symbolic else 'with'} symbolic shape inference: {_where(exc)}")
            continue
        return out_path, f"quant_pre_process failed {failures[0]}; ran with skip_symbolic_shape=True" if failures \
            else ""
    return float_path, f"quant_pre_process failed ({'; '.join(failures)}); quantized without it"


def _where(exc: Exception) -> str:
    """``AssertionError at symbolic_shape_infer.py:1690 (_infer_Reshape): assert is_literal(shape_rank)``."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    message = (str(exc).strip().splitlines() or [""])[0][:200]
    return (f"{type(exc).__name__}{': ' + message if message else ''} at {Path(frame.filename).name}:{frame.lineno} "
            f"({frame.name}): {frame.line}")


def session_options(threads: int, *, profile_prefix: str | None = None) -> Any:
    """``threads`` intra-op threads, one inter-op, sequential, every graph optimisation (ORT's fusions into QLinear*
    kernels run at ``ORT_ENABLE_ALL``), and intra-op threads that block instead of spinning when a call ends: spinning,
    they held the second of two cores through the next candidate's call in an interleaved round (mlp at batch 8, two
    threads: every other candidate 2.5x slower, ONNX Runtime itself 2.12 against 2.13 ms; docs/benchmarks.md,
    "Method"); ``profile_prefix``: write ORT's profile (a JSON trace) under that prefix."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


class OrtSessions:
    """A model's InferenceSession per intra-op thread count (:func:`session_options`), created on first use."""

    def __init__(self, model_bytes: bytes, names: list[str]) -> None:
        self.model_bytes = model_bytes
        self.names = names
        self.sessions: dict[int, Any] = {}

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()
        if threads not in self.sessions:
            import onnxruntime as ort

            self.sessions[threads] = ort.InferenceSession(self.model_bytes, session_options(threads),
                                                          providers=["CPUExecutionProvider"])
        return torch.from_numpy(self.sessions[threads].run(None, self.feed(inputs))[0])

    def feed(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        return {name: x.numpy() for name, x in zip(self.names, inputs, strict=True)}


@dataclass(frozen=True)
class StaticOnnx:
    """The float ONNX export and its ``quantize_static`` model, with the input names and a note on pre-processing."""

    names: list[str]
    float_model: bytes
    int8_model: bytes
    note: str


def quantize_static_onnx(workload: Workload) -> StaticOnnx:
    """The float model exported to ONNX, pre-processed, and ``quantize_static``-ed on the workload's batches."""
    with tempfile.TemporaryDirectory() as tmp:
        float_path, int8_path = Path(tmp, "float.onnx"), Path(tmp, "int8.onnx")
        names = _export_onnx(workload, float_path)
        source, note = _pre_process(float_path, Path(tmp, "float_pre.onnx"))
        _quantize(workload, names, source, int8_path)
        return StaticOnnx(names, _inline_bytes(float_path), int8_path.read_bytes(), note)


def _inline_bytes(path: Path) -> bytes:
    """The model with its weights inside: the dynamo exporter keeps them in a ``.data`` file next to it."""
    import onnx

    return onnx.load(str(path)).SerializeToString()


@register_peer
class OnnxRuntimeStatic(Peer):
    """ONNX Runtime ``quantize_static``: QDQ format, QUInt8 activations, QInt8 per-channel weights."""

    name = "ort"
    label = "ONNX Runtime"
    requires = ("onnxruntime", "onnx")

    def build(self, workload: Workload) -> Candidate:
        static = quantize_static_onnx(workload)
        return Candidate(self.label, OrtSessions(static.int8_model, static.names), lazy=True, note=static.note)

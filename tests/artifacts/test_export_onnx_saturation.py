"""ONNX Runtime on a CPU without VNNI: its u8*s8 GEMM adds pairs of products in 16 bits, so a file whose activations
use all 8 bits saturates there, and one with 7-bit activations (a model converted for onednn on such a CPU, or under
``FXQUANT_ISA=avx512``) is exact. The pitfall is pinned only where it occurs; the workaround is checked everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fxquant
from fxquant.native.isa import cpu_sums_int8_exactly
from fxquant.nn.quantized import QuantizedLinear
from fxquant.state import graph_of
from fxquant.testing import relowered

ort = pytest.importorskip("onnxruntime", reason="the optional 'onnx' extra (onnxruntime) is not installed")
pytest.importorskip("onnxscript", reason="the optional 'onnx' extra (onnxscript) is not installed")


def _exported(tmp_path: Path, backend: str) -> tuple[Path, nn.Module, torch.Tensor, float]:
    """A Linear(64, 32) calibrated on uniform inputs (every activation byte in use), converted for ``backend``, its
    ONNX file, fresh inputs and the output step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32)).eval()
    data = [(torch.rand(8, 64) * 4,) for _ in range(4)]
    prepared = fxquant.prepare(model, data[0])
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared, backend=backend)
    path = fxquant.export(qmodel, tmp_path / f"{backend}.onnx")
    layer = next(m for m in graph_of(qmodel).modules() if isinstance(m, QuantizedLinear))
    return path, qmodel, torch.rand(16, 64) * 4, float(layer.out_qp.scale)


def _ort_steps(path: Path, qmodel: nn.Module, x: torch.Tensor, step: float) -> float:
    """How many output steps ONNX Runtime (one thread) is from the reference arithmetic on the file's qparams."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    return float((got - relowered(qmodel, "reference")(x)).abs().max()) / step


def test_8_bit_activations_saturate_in_onnx_runtime_without_vnni(tmp_path: Path) -> None:
    if cpu_sums_int8_exactly():
        pytest.skip("this CPU has VNNI or AMX: ONNX Runtime's int8 GEMM sums in 32 bits, nothing saturates")
    path, qmodel, x, step = _exported(tmp_path, "reference")
    assert _ort_steps(path, qmodel, x, step) > 2  # measured 17.6 steps on a Zen 1 EPYC (AVX2 only)


def test_7_bit_activations_are_exact_in_onnx_runtime_on_any_cpu(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXQUANT_ISA", "avx512")  # onednn's activations are 7-bit below VNNI
    path, qmodel, x, step = _exported(tmp_path, "onednn")
    layer = next(m for m in graph_of(qmodel).modules() if isinstance(m, QuantizedLinear))
    assert layer.in_qp.qmax == 127
    assert _ort_steps(path, qmodel, x, step) <= 1 + 1e-4

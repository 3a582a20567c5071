"""The real-models zoo exported: every architecture's ``.pt2`` is the reference backend bit for bit, and every
architecture ONNX can express runs in ONNX Runtime on its INT8 kernels, as close to the reference as fxquant's own
oneDNN backend is. A few architectures run in the default suite; the rest are marked slow."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fxquant
from fxquant.artifacts.export.sidecar import qparams_digest
from fxquant.errors import ArtifactError
from fxquant.nn.quantized import _QuantizedWeighted
from fxquant.testing import relowered

pytest.importorskip("transformers", reason="the optional 'transformers' extra is not installed")
pytest.importorskip("onnxruntime", reason="the optional 'onnx' extra is not installed")
pytest.importorskip("onnxscript", reason="the optional 'onnx' extra is not installed")

import hf_zoo  # after importorskip: it imports transformers
import onnxruntime as ort

# the default suite's two: an encoder with a conv stem (ViT) and a decoder on HF's Conv1D (GPT-2), 35 and 38 s on a
# Zen 1 core; the other families' exports (31-53 s each) run with -m slow
DEFAULT = {"vit", "gpt2"}
# torch.onnx 2.13 cannot export these float models either ("Cannot view a tensor ... as", a view after a transpose)
ONNX_CANNOT = {"t5_encoder", "swin"}
INT8_KERNELS = {"QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger", "ConvInteger",
                "QLinearConvTranspose", "DynamicQuantizeMatMul"}
# Every INT8 Linear is a Gemm and every INT8 conv a Conv in the file: one of these running in float is a fallback
# (attention's activation-by-activation products are float MatMuls in the model itself)
FLOAT_KERNELS = {"Conv", "Gemm", "FusedConv", "FusedGemm", "ConvTranspose"}


def _params() -> list[Any]:
    return [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.slow) for name in hf_zoo.ARCHS]


@functools.cache
def _converted(name: str, scheme: str = "auto") -> tuple[Any, Any, tuple[Any, ...], tuple[Any, ...], Any]:
    model = hf_zoo.build(name)
    data = hf_zoo.batches(name, 4)
    example = hf_zoo.positional(model, data[0])
    prepared = fxquant.prepare(model, example, fxquant.QuantConfig(scheme=scheme))
    fxquant.calibrate(prepared, data, progress=False)
    fresh = hf_zoo.positional(model, hf_zoo.batches(name, 1, seed=100)[0])
    return fxquant.convert(prepared), fxquant.convert(prepared, backend="reference"), example, fresh, model


def _on_reference(qmodel: Any, reference: Any) -> Any:
    """The reference arithmetic on ``qmodel``'s qparams: the reference conversion where they are the same (a CPU
    with VNNI), else ``qmodel`` re-lowered (oneDNN's 7-bit activations without VNNI)."""
    same = qparams_digest(fxquant.state.graph_of(qmodel)) == qparams_digest(fxquant.state.graph_of(reference))
    return reference if same else relowered(qmodel, "reference")


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _sqnr(reference: torch.Tensor, actual: torch.Tensor) -> float:
    noise = (reference.double() - actual.double()).pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise.clamp(min=1e-30)))


@pytest.mark.parametrize("name", _params())
def test_pt2_is_the_reference_backend_bit_for_bit(name: str, tmp_path: Path) -> None:
    qmodel, reference, example, fresh, _ = _converted(name)
    path = fxquant.export(qmodel, tmp_path / "model.pt2", example_inputs=example)
    program = torch.export.load(str(path)).module()
    with torch.inference_mode():
        expected = hf_zoo.main_output(name, _on_reference(qmodel, reference)(*fresh))
    got = _first(program(*fresh))
    assert torch.equal(got, expected), f"{name}: max |diff| {(got - expected).abs().max():.3g}"


@pytest.mark.parametrize("name", _params())
def test_onnx_runs_on_ort_int8_kernels_as_close_as_onednn(name: str, tmp_path: Path) -> None:
    """Static W8A8 (the default everywhere but decoder-only LMs, named here for those), whose QDQ ONNX runs on ORT's
    INT8 kernels; the dynamic scheme the decoders default to exports as .pt2 (the next test)."""
    qmodel, reference, example, fresh, model = _converted(name, "static")
    if name in ONNX_CANNOT:
        with pytest.raises(ArtifactError, match=r"torch.onnx cannot express this model: .*modeling_"):
            fxquant.export(qmodel, tmp_path / "model.onnx", example_inputs=example)
        assert not (tmp_path / "model.onnx").exists()
        return
    path = fxquant.export(qmodel, tmp_path / "model.onnx", example_inputs=example)
    options = ort.SessionOptions()
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = [value for value in fresh if value is not None]
    got = torch.from_numpy(session.run(None, {i.name: v.numpy() for i, v in zip(session.get_inputs(), feeds,
                                                                                   strict=True)})[0])
    ran = [event["args"]["op_name"] for event in json.loads(Path(session.end_profiling()).read_text())
           if event.get("cat") == "Node" and event["name"].endswith("_kernel_time")]
    with torch.inference_mode():
        expected = hf_zoo.main_output(name, _on_reference(qmodel, reference)(*fresh))
        onednn = hf_zoo.main_output(name, qmodel(*fresh))
        float_out = hf_zoo.main_output(name, model(*fresh))
    layers = sum(isinstance(m, _QuantizedWeighted) for m in fxquant.state.graph_of(qmodel).modules())
    assert sum(op in INT8_KERNELS for op in ran) >= layers, f"{name}: {sorted(set(ran))}"
    assert not FLOAT_KERNELS & set(ran), f"{name}: float kernels ran: {sorted(FLOAT_KERNELS & set(ran))}"
    # As close to the reference as fxquant's own oneDNN backend, or, where QDQ rounds a conv feeding an add twice
    # (the reference and oneDNN once), at most half as far from it as INT8 itself is from the float model (6 dB;
    # measured: 6.8 dB on efficientnet_style, the worst)
    ort_db, onednn_db = _sqnr(expected, got), _sqnr(expected, onednn)
    int8_db = _sqnr(float_out, expected)
    assert ort_db >= min(onednn_db - 3.0, int8_db + 6.0), \
        f"{name}: ORT {ort_db:.1f} dB from the reference, onednn {onednn_db:.1f}, INT8 from float {int8_db:.1f}"


@pytest.mark.parametrize(("scheme", "resolved"), [("auto", "dynamic_group"), ("dynamic", "dynamic"),
                                                  ("weight_only", "weight_only")])
def test_onnx_of_a_decoders_scheme_layers_names_the_layer_and_the_pt2_format(tmp_path: Path, scheme: str,
                                                                             resolved: str) -> None:
    qmodel, _, example, _, _ = _converted("llama", scheme)
    assert fxquant.state.quant_state(fxquant.state.graph_of(qmodel)).config.scheme == resolved
    with pytest.raises(ArtifactError, match=rf"model\.layers\.0\..* runs the '{resolved}' scheme.*format='export'"):
        fxquant.export(qmodel, tmp_path / "model.onnx", example_inputs=example)
    assert not (tmp_path / "model.onnx").exists()

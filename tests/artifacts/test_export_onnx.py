"""``fxquant.export(qmodel, "x.onnx")`` in ONNX Runtime: each INT8 op within one output step of the reference
backend, one ORT INT8 kernel per INT8 Linear/Conv layer (its profiler says what ran), free batch axes, zoo models as
close to the reference as fxquant's own oneDNN backend, the same file whichever backend shares the qparams, and the
manifest that describes it.

Every ORT session runs on the CPU provider with one thread. Inputs are fresh samples of the calibration
distribution. An output step is the scale of the qparams the model's output was rounded to (its last INT8 layer's
``out_qp``, or the final DeQuantize's)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.models import create_model, example_inputs
from fxquant.native.isa import cpu_sums_int8_exactly, has_vnni
from fxquant.nn.quantized import DeQuantize, _QuantizedWeighted
from fxquant.state import graph_of
from fxquant.testing import relowered

pytest.importorskip("onnx", reason="the optional 'onnx' extra (onnx) is not installed")
pytest.importorskip("onnxscript", reason="the optional 'onnx' extra (onnxscript) is not installed")
ort = pytest.importorskip("onnxruntime", reason="the optional 'onnx' extra (onnxruntime) is not installed")

INT8_KERNELS = {"QLinearConv", "QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger", "ConvInteger",
                "QLinearConvTranspose", "DynamicQuantizeMatMul"}
FLOAT_KERNELS = {"Conv", "Gemm", "MatMul", "FusedConv", "FusedGemm", "FusedMatMul", "ConvTranspose"}
STEP_SLACK = 1e-4  # float32 noise in "deviation / step"
SLOW = pytest.mark.slow  # 5-15 s each to build and export


class Case(NamedTuple):
    factory: Callable[[], nn.Module]
    shape: tuple[int, ...]  # one sample
    backend: str = "reference"  # what the exported model is converted for
    against: str = "reference"  # the backend whose output the ORT output is compared with
    also_runs: str | None = None  # an ORT op that must run besides the INT8 kernels


class _TwoConvs(nn.Module):
    def __init__(self, join: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.b, self.join = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1), join

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.join(self.a(x), self.b(x))


def _conv(*after: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A conv, then ``make()`` of each of ``after``, all built per call: seeded, the same weights in every process."""
    return lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *(make() for make in after))


IMAGE = (3, 12, 12)
CASES = {
    "conv2d": Case(_conv(), IMAGE),
    "conv2d_relu": Case(_conv(nn.ReLU), IMAGE),
    "depthwise_conv": Case(lambda: nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8)), (8, 12, 12)),
    "conv1d": Case(lambda: nn.Sequential(nn.Conv1d(4, 8, 3)), (4, 20)),
    "linear_2d": Case(lambda: nn.Sequential(nn.Linear(16, 8)), (16,)),
    "linear_2d_no_bias": Case(lambda: nn.Sequential(nn.Linear(16, 8, bias=False)), (16,)),
    "linear_3d": Case(lambda: nn.Sequential(nn.Linear(16, 8)), (5, 16)),
    "linear_3d_no_bias": Case(lambda: nn.Sequential(nn.Linear(16, 8, bias=False)), (5, 16)),
    "linear_relu": Case(lambda: nn.Sequential(nn.Linear(16, 8), nn.ReLU()), (16,)),
    "residual_add": Case(lambda: _TwoConvs(torch.add), IMAGE),
    "mul": Case(lambda: _TwoConvs(torch.mul), IMAGE),
    "cat": Case(lambda: _TwoConvs(lambda a, b: torch.cat([a, b], 1)), IMAGE),
    "max_pool": Case(_conv(lambda: nn.MaxPool2d(2)), IMAGE),
    "avg_pool": Case(_conv(lambda: nn.AvgPool2d(2)), IMAGE),
    "adaptive_avg_pool": Case(_conv(lambda: nn.AdaptiveAvgPool2d(1)), IMAGE),
    # reference/onednn fold SiLU into the conv's float output; fbgemm makes it a 256-byte table lookup (a Gather),
    # which no reference-backend model has: that case is checked against the fbgemm model it was exported from
    "silu_between_convs": Case(_conv(nn.SiLU, lambda: nn.Conv2d(8, 4, 1)), IMAGE),
    "silu_lookup": Case(_conv(nn.SiLU, lambda: nn.Conv2d(8, 4, 1)), IMAGE, "fbgemm", "fbgemm", also_runs="GatherND"),
    "sigmoid": Case(_conv(nn.Sigmoid), IMAGE),
    "conv_transpose2d": Case(lambda: nn.Sequential(nn.ConvTranspose2d(3, 8, 2, stride=2)), IMAGE),
}
# Output steps allowed beyond one: where the conv before sigmoid's exact table rounds one step from the reference (a
# tie; 2.0 steps at 1 of 18432 values was measured, the QDQ form's own eager run too), sigmoid's slope doubles it.
# silu_lookup chains three int8 ops: ORT's first conv rounds 1 in ~1000 bytes one step from fbgemm's (16 of 18432),
# the table's slope (its input step / output step x SiLU') makes that 2 table steps, and the 1x1 conv carries them
# to its output: 2.0 steps at 1 of 9216 outputs, in 1 of 51 seeds tried with one conv (tests run seed 0)
EXTRA_STEPS = {"sigmoid": 1, "silu_lookup": 1}

TOKENS = 32
# Well-conditioned zoo variants (tests/test_zoo_quantization.py: random deep nets with depthwise stages are chaotic)
ZOO = {
    "mlp": ({"in_features": 128, "hidden": 128, "out_features": 32}, (128,)),
    "resnet18": ({"num_classes": 10, "residual_gamma": 0.25}, (3, 64, 64)),
    "mobilenetv2": ({"num_classes": 10, "settings": ((1, 16, 1, 1), (6, 24, 2, 2))}, (3, 64, 64)),
    "bert_style": ({"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128, "seq_len": TOKENS}, (TOKENS,)),
}
NEEDS_ONEDNN = pytest.mark.skipif("onednn" not in available_backends(), reason="this torch/CPU has no onednn")
ZOO_PARAMS = [pytest.param(name, marks=[NEEDS_ONEDNN] + ([] if name == "mlp" else [SLOW])) for name in ZOO]


def _case_params() -> list[Any]:
    params = []
    for name, case in CASES.items():
        missing = {case.backend, case.against} - set(available_backends())
        marks = [pytest.mark.skip(reason=f"backend {sorted(missing)} not available here")] if missing else []
        params.append(pytest.param(name, marks=marks))
    return params


def _batches(shape: tuple[int, ...], batch: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Random samples; a 1-d sample of ``TOKENS`` positions is token ids (bert_style's vocabulary of 1000)."""
    generator = torch.Generator().manual_seed(seed)
    if shape == (TOKENS,):
        return [(torch.randint(0, 1000, (batch, *shape), generator=generator),) for _ in range(count)]
    return [(torch.randn(batch, *shape, generator=generator),) for _ in range(count)]


def _calibrated(model: nn.Module, shape: tuple[int, ...], *, seed: int = 0) -> fx.GraphModule:
    data = _batches(shape, 4, 5, seed)
    prepared = fxquant.prepare(model, tuple(t[:2] for t in data[0]))  # exported at batch 2
    fxquant.calibrate(prepared, data, progress=False)
    return prepared


def _session(path: Path, profile: Path | None = None) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    if profile is not None:
        options.enable_profiling, options.profile_file_prefix = True, str(profile)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run(session: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    feeds = {value.name: x.numpy() for value, x in zip(session.get_inputs(), inputs, strict=True)}
    outputs = session.run(None, feeds)
    assert len(outputs) == 1, f"{len(outputs)} outputs"
    return torch.from_numpy(outputs[0])


def _kernels(path: Path, inputs: tuple[torch.Tensor, ...]) -> list[str]:
    """The op of every node ORT ran in one call."""
    session = _session(path, profile=path.with_name(path.name + ".profile"))
    _run(session, inputs)
    events = json.loads(Path(session.end_profiling()).read_text())
    return [e["args"]["op_name"] for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def _output_step(qmodel: nn.Module) -> float:
    gm = graph_of(qmodel)
    node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    module = gm.get_submodule(str(node.target)) if isinstance(node, fx.Node) and node.op == "call_module" else None
    qp = module.qp if isinstance(module, DeQuantize) else getattr(module, "out_qp", None)
    if qp is None:  # a float module (bert's LayerNorm): the last INT8 layer's grid
        qp = [m for m in gm.modules() if isinstance(m, _QuantizedWeighted)][-1].out_qp
    return float(qp.scale)


def _int8_layers(qmodel: nn.Module) -> int:
    return sum(isinstance(m, _QuantizedWeighted) for m in graph_of(qmodel).modules())


def _float_products(qmodel: nn.Module) -> int:
    """Activation-by-activation products the converted model computes in float (attention: two per call)."""
    products = {torch.matmul: 1, torch.bmm: 1, F.scaled_dot_product_attention: 2}
    return sum(products.get(n.target, 0) for n in graph_of(qmodel).graph.nodes if n.op == "call_function")


class Exported(NamedTuple):
    path: Path
    qmodel: nn.Module
    fresh: tuple[torch.Tensor, ...]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Exported]:
    root = tmp_path_factory.mktemp("single")

    @functools.cache
    def build(name: str) -> Exported:
        case = CASES[name]
        torch.manual_seed(0)
        prepared = _calibrated(case.factory().eval(), case.shape)
        # ORT without VNNI saturates on 8-bit activations (test_export_onnx_saturation.py): onednn's are 7-bit there
        backend = "onednn" if case.backend == "reference" and not cpu_sums_int8_exactly() else case.backend
        qmodel = fxquant.convert(prepared, backend=backend)
        path = fxquant.export(qmodel, root / f"{name}.onnx")
        return Exported(path, qmodel, _batches(case.shape, 16, 1, seed=100)[0])

    return build


@pytest.mark.parametrize("name", _case_params())
def test_single_op_within_one_output_step_of_the_reference(name: str, single: Callable[[str], Exported]) -> None:
    path, qmodel, fresh = single(name)
    expected = relowered(qmodel, CASES[name].against)(*fresh)  # its arithmetic on the file's qparams
    got = _run(_session(path), fresh)
    assert got.shape == expected.shape
    steps = float((got - expected).abs().max()) / _output_step(qmodel)
    allowed = 1 + EXTRA_STEPS.get(name, 0)
    assert steps <= allowed + STEP_SLACK, f"{name}: ORT is {steps:.3f} output steps from {CASES[name].against}"


# ORT 1.32's CPU provider has no INT8 transposed convolution: its QDQ ConvTranspose runs in float (docs/export.md)
ORT_CPU_FLOAT = {"conv_transpose2d"}


@pytest.mark.parametrize("name", [p for p in _case_params() if p.values[0] not in ORT_CPU_FLOAT])
def test_single_op_runs_on_one_int8_kernel_per_layer(name: str, single: Callable[[str], Exported]) -> None:
    path, qmodel, fresh = single(name)
    ran = _kernels(path, fresh)
    assert sum(op in INT8_KERNELS for op in ran) == _int8_layers(qmodel), f"{name}: ran {ran}"
    assert not FLOAT_KERNELS & set(ran), f"{name}: float kernels ran: {ran}"
    assert CASES[name].also_runs in (None, *ran), f"{name}: no {CASES[name].also_runs} ran: {ran}"


def test_conv_transpose_is_qdq_but_ort_cpu_runs_it_in_float(single: Callable[[str], Exported]) -> None:
    """The file holds the int8 weight and its DequantizeLinear (a QDQ consumer with an INT8 transposed conv, QNN or
    XNNPACK, fuses it); ORT's CPU provider runs ConvTranspose on the dequantized weight. When ORT gains the kernel,
    this fails and docs/export.md changes."""
    import onnx

    path, _, fresh = single("conv_transpose2d")
    graph = onnx.load(str(path)).graph
    assert any(init.data_type == onnx.TensorProto.INT8 and len(init.dims) == 4 for init in graph.initializer)
    ran = _kernels(path, fresh)
    assert "ConvTranspose" in ran and not INT8_KERNELS & set(ran), ran



@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Exported, nn.Module, nn.Module]]:
    """name -> (the export of its onednn model, that model, its reference model)."""
    root = tmp_path_factory.mktemp("zoo")

    @functools.cache
    def build(name: str) -> tuple[Exported, nn.Module, nn.Module]:
        options, shape = ZOO[name]
        torch.manual_seed(0)
        prepared = _calibrated(create_model(name, **options), shape)
        onednn = fxquant.convert(prepared, backend="onednn")
        path = fxquant.export(onednn, root / f"{name}.onnx")
        fresh = _batches(shape, 32, 1, seed=100)[0]
        return Exported(path, onednn, fresh), onednn, fxquant.convert(prepared, backend="reference")

    return build


@pytest.mark.parametrize("name", ZOO_PARAMS)
def test_zoo_model_runs_at_other_batch_sizes(name: str, zoo: Callable[..., Any]) -> None:
    exported, _, _ = zoo(name)
    manifest = json.loads(exported.path.with_name(exported.path.name + ".fxquant.json").read_text())
    assert manifest["dynamic_axes"] == [[0, 1] if name == "bert_style" else [0]]
    session = _session(exported.path)
    assert isinstance(session.get_inputs()[0].shape[0], str), session.get_inputs()[0].shape  # symbolic
    whole = _run(session, exported.fresh)
    for batch in (1, 5):  # the file was exported at batch 2; ORT's INT8 kernels compute each sample alone
        rows = _run(session, tuple(x[:batch] for x in exported.fresh))
        assert rows.shape == (batch, *whole.shape[1:])
        assert torch.equal(rows, whole[:batch]), f"{name} at batch {batch}: {(rows - whole[:batch]).abs().max()}"


@pytest.mark.parametrize("name", ZOO_PARAMS)
def test_zoo_model_runs_on_one_int8_kernel_per_layer(name: str, zoo: Callable[..., Any]) -> None:
    exported, onednn, _ = zoo(name)
    ran = _kernels(exported.path, exported.fresh)
    assert sum(op in INT8_KERNELS for op in ran) == _int8_layers(onednn), f"{name}: {sorted(set(ran))}"
    floats = [op for op in ran if op in FLOAT_KERNELS]
    assert len(floats) == _float_products(onednn), f"{name}: float kernels ran: {floats}"


@pytest.mark.parametrize("name", ZOO_PARAMS)
def test_zoo_model_is_as_close_to_the_reference_as_onednn(name: str, zoo: Callable[..., Any]) -> None:
    exported, onednn, reference = zoo(name)
    with torch.inference_mode():
        expected, ours = reference(*exported.fresh), onednn(*exported.fresh)
    step = _output_step(reference)
    ort_steps = float((_run(_session(exported.path), exported.fresh) - expected).abs().max()) / step
    onednn_steps = float((ours - expected).abs().max()) / step
    assert ort_steps <= onednn_steps + 1, f"{name}: ORT {ort_steps:.2f} steps from the reference, onednn " \
                                          f"{onednn_steps:.2f}"


@pytest.mark.parametrize("name", ZOO_PARAMS)
def test_zoo_model_top1_agrees_with_the_reference(name: str, zoo: Callable[..., Any]) -> None:
    exported, _, reference = zoo(name)
    with torch.inference_mode():  # bert_style: per token, over its hidden features
        expected = reference(*exported.fresh).argmax(-1)
    agreement = float((_run(_session(exported.path), exported.fresh).argmax(-1) == expected).float().mean())
    assert agreement >= 0.95, f"{name}: top-1 agrees with the reference on {agreement:.1%} of 32 inputs"


@pytest.fixture(scope="module")
def per_backend(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.Tensor, float]]:
    """backend -> (the ONNX file of the digits CNN converted for it, ORT's output on fresh inputs, the model's
    output step); one calibration."""
    root = tmp_path_factory.mktemp("backends")
    torch.manual_seed(0)
    prepared = _calibrated(create_model("digits_cnn"), (1, 8, 8))
    fresh = example_inputs("digits_cnn", 16, seed=100)

    @functools.cache
    def build(backend: str) -> tuple[Path, torch.Tensor, float]:
        qmodel = fxquant.convert(prepared, backend=backend)
        path = fxquant.export(qmodel, root / f"{backend}.onnx")
        return path, _run(_session(path), fresh), _output_step(qmodel)

    return build


# Without VNNI, onednn takes 7-bit activations (docs/backends.md): other qparams than the reference's, another file
SEVEN_BIT = pytest.mark.skipif(not has_vnni(), reason="this CPU (or ONEDNN_MAX_CPU_ISA) has no VNNI: onednn's "
                                                      "activations are 7-bit, so its qparams are not the reference's")


def _backends() -> list[Any]:
    marks = {"fbgemm": (SLOW, SEVEN_BIT), "qnnpack": SLOW, "onednn": SEVEN_BIT}
    return [pytest.param(b, marks=marks.get(b, ())) for b in available_backends() if b != "reference"]


@pytest.mark.parametrize("backend", _backends())
def test_every_backend_exports_the_same_onnx_outputs(backend: str, per_backend: Callable[..., Any]) -> None:
    """The QDQ form depends only on the qparams and the graph: a onednn model's file computes exactly what the
    reference model's does. fbgemm/qnnpack graphs round the last Linear to its output qparams (they have no
    float-output kernel: a DeQuantize follows it), so theirs is within half an output step of it."""
    _, got, _ = per_backend(backend)
    _, expected, step = per_backend("reference")
    if backend in ("fbgemm", "qnnpack"):
        steps = float((got - expected).abs().max()) / step
        assert steps <= 0.5 + STEP_SLACK, f"{backend}: {steps:.3f} output steps from the reference's file"
    else:
        assert torch.equal(got, expected), f"{backend}: max |diff| {(got - expected).abs().max()} from the reference's"


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.with_name(path.name + ".fxquant.json").read_text())


def test_manifest_describes_the_file(per_backend: Callable[..., Any]) -> None:
    path = per_backend("reference")[0]
    manifest = _manifest(path)
    assert manifest["export_format"] == "onnx" and manifest["file"] == path.name
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["bytes"] == path.stat().st_size
    assert manifest["backend"] == "reference" and manifest["opset"] == 21
    assert manifest["dynamic_axes"] == [[0]] and manifest["inputs"] == [{"shape": [2, 1, 8, 8], "dtype": "float32"}]
    assert re.fullmatch("[0-9a-f]{64}", manifest["qparams_sha256"]), manifest["qparams_sha256"]


@pytest.mark.parametrize("backend", _backends())
def test_qparams_digest_is_the_same_for_every_backend(backend: str, per_backend: Callable[..., Any]) -> None:
    digest = _manifest(per_backend(backend)[0])["qparams_sha256"]
    assert digest == _manifest(per_backend("reference")[0])["qparams_sha256"], backend


def test_qparams_digest_follows_the_calibration(per_backend: Callable[..., Any], tmp_path: Path) -> None:
    reference = _manifest(per_backend("reference")[0])
    torch.manual_seed(0)
    other = _calibrated(create_model("digits_cnn"), (1, 8, 8), seed=1)  # same weights, other calibration data
    path = fxquant.export(fxquant.convert(other, backend="reference"), tmp_path / "other.onnx")
    assert _manifest(path)["qparams_sha256"] != reference["qparams_sha256"]
    assert _manifest(path)["sha256"] != reference["sha256"]


class _ResidualNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x) + x)


@pytest.mark.parametrize("rewrite", [True, False])
def test_a_norm_after_a_float_add_is_not_fused_into_skip_layer_norm(rewrite: bool, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT fuses Add -> LayerNormalization into its slow SkipLayerNormalization unless the export keeps them apart;
    without the rewrite (the control) the fusion happens, so the check can fail."""
    import onnx
    import onnxruntime as ort

    from fxquant.artifacts.export import onnx as onnx_export

    if not rewrite:
        monkeypatch.setattr(onnx_export, "keep_add_and_layer_norm_apart", lambda graph: 0)
    prepared = _calibrated(_ResidualNorm().eval(), (8, 16))
    path = fxquant.export(fxquant.convert(prepared, backend="reference"), tmp_path / "m.onnx")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = {node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert ("SkipLayerNormalization" in ops) is not rewrite, sorted(ops)

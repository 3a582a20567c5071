"""Hugging Face architectures (tiny configs, random weights, no download) and timm/efficientnet_pytorch-style CNNs
through the whole pipeline: prepared == float, convert with the default config, INT8 SQNR floor, coverage (every
layer listed, every Linear/Conv INT8 or float for a stated reason, INT8 share of the multiply-adds), and an output of
the float model's type.

Each model runs through prepare -> calibrate -> convert once (cached); the tests read that run.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import fxquant
from fxquant.state import graph_of, quant_state
from fxquant.testing import assert_sqnr, seven_bit_margin_db

pytest.importorskip("transformers", reason="the optional 'transformers' extra is not installed")

import hf_zoo  # after importorskip: it imports transformers

# SQNR floors (dB) of the main output vs float on fresh inputs, default backend (onednn), measured as _run runs
# (the prepared model observes every call, so the example batch, the first calibration batch, counts twice): the
# lowest over model/data seeds 0-2 (AMD EPYC, AVX512-VNNI; a repeated seed gives the same figure), less 3 dB,
# rounded down, less the 6 dB one bit fewer costs where static activations have 7 bits (seven_bit_margin_db). The
# decoder-only LMs (gpt2 ... falcon) run the default scheme's choice for them, dynamic W8A8 with a scale per group
# of 128 inputs of each row, whose int8 rows do not depend on the backend's activation range (floors measured under
# per-token scales: most of these toy Linears have at most 128 inputs, one group, so both schemes measure alike).
SQNR_FLOORS: dict[str, float] = {
    "bert": 62.0, "distilbert": 60.0, "roberta": 60.0, "electra": 37.0, "albert": 37.0, "deberta_v2": 59.0,
    "modernbert": 76.0, "t5_encoder": 30.0,
    "gpt2": 35.0, "opt": 33.0, "llama": 34.0, "qwen2": 34.0, "qwen3": 33.0, "mistral": 34.0, "phi3": 34.0,
    "gemma": 38.0, "gpt_neox": 33.0, "falcon": 32.0,
    "vit": 29.0, "deit": 22.0, "dinov2": 29.0, "swin": 28.0, "convnext": 20.0, "mobilevit": 36.0,
    "segformer": 38.0, "resnet": 29.0,
    "wav2vec2": 31.0, "hubert": 30.0, "whisper_encoder": 58.0, "whisper_decoder": 28.0,
    "efficientnet_style": 37.0, "convnext_timm_style": 29.0,
}
# Layers expected to stay float, path -> a substring of coverage's reason. None today: every layer of every model
# here runs INT8 (a float one is a defect to fix, not to list).
EXPECTED_FLOAT: dict[str, dict[str, str]] = {}
# Floors of coverage's int8_mac_fraction where layers are expected float (1.0 elsewhere).
MAC_FLOORS: dict[str, float] = {}
# Models with BatchNorm: prepare folds it into the conv before (fold_batchnorm), which changes float rounding
# (w * gamma / sqrt(var + eps) is rounded once, then convolved), so prepared == float within float error only.
FOLDS_BATCHNORM = {"resnet", "mobilevit", "efficientnet_style"}
# MobileViT's stage depths are fixed by the architecture: 90 layers in 51 islands, several times any other model here.
SLOW = {"mobilevit"}


@dataclass(frozen=True)
class Run:
    model: nn.Module
    float_out: Any  # the float model's output on the example inputs
    prepared_out: Any  # the prepared model's, before calibration
    qmodel: nn.Module  # a drop-in model (the user's class) where the root does not trace, else a GraphModule
    seconds: float


@functools.cache
def _run(name: str) -> Run:
    start = time.perf_counter()
    model = hf_zoo.build(name)
    data = hf_zoo.batches(name, 4)
    example = hf_zoo.positional(model, data[0])
    prepared = fxquant.prepare(model, example)
    with torch.inference_mode():
        float_out, prepared_out = model(*example), prepared(*example)
    fxquant.calibrate(prepared, data, progress=False)
    qmodel = fxquant.convert(prepared)
    return Run(model, float_out, prepared_out, qmodel, time.perf_counter() - start)


@functools.cache
def _fresh_outputs(name: str) -> tuple[Any, Any]:
    """The float and INT8 models' outputs on inputs that neither calibration nor the example used."""
    run, fresh = _run(name), hf_zoo.batches(name, 1, seed=100)[0]
    with torch.inference_mode():
        return run.model(**fresh), run.qmodel(**fresh)


def _cases() -> list[Any]:
    cases = []
    for name in hf_zoo.ARCHS:
        marks = [pytest.mark.slow] if name in SLOW else []
        cases.append(pytest.param(name, marks=marks, id=name))
    return cases


def test_the_zoo_has_every_family_and_a_floor_for_each() -> None:
    assert len(hf_zoo.ARCHS) >= 27
    assert set(SQNR_FLOORS) == set(hf_zoo.ARCHS)


@pytest.mark.parametrize("name", _cases())
def test_prepared_model_computes_the_float_model(name: str) -> None:
    run = _run(name)
    expected, actual = hf_zoo.main_output(name, run.float_out), hf_zoo.main_output(name, run.prepared_out)
    assert actual.shape == expected.shape, f"{name}: prepared output {tuple(actual.shape)} vs {tuple(expected.shape)}"
    diff = (actual - expected).abs().max().item()
    if name in FOLDS_BATCHNORM:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=f"{name}: max abs diff {diff:.3g}")
    else:
        assert torch.equal(actual, expected), f"{name}: prepared output differs from float: max abs diff {diff:.3g}"


@pytest.mark.parametrize("name", _cases())
def test_int8_output_meets_its_sqnr_floor(name: str) -> None:
    run, (reference, actual) = _run(name), _fresh_outputs(name)
    config = quant_state(graph_of(run.qmodel)).config
    floor = SQNR_FLOORS[name] - (seven_bit_margin_db(config.backend) if config.scheme == "static" else 0.0)
    assert_sqnr(hf_zoo.main_output(name, reference), hf_zoo.main_output(name, actual), floor,
                f"{name} INT8 vs float ({run.seconds:.1f} s to prepare, calibrate and convert)")


def _float_layers(model: nn.Module) -> list[str]:
    """Paths of the float model's matmul/conv layers: Linear, the convs and their subclasses, transformers' Conv1D."""
    return [path for path, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) or type(m).__name__ == "Conv1D"]


@pytest.mark.parametrize("name", _cases())
def test_coverage_lists_every_layer_and_each_is_int8_or_float_for_its_reason(name: str) -> None:
    run = _run(name)
    report = fxquant.coverage(run.qmodel)
    paths = [row.path for row in report.layers]
    missing = [p for p in _float_layers(run.model) if not any(r == p or r.startswith(f"{p}.") for r in paths)]
    assert not missing, f"{name}: layers absent from the coverage report: {missing}\n{report}"
    expected = EXPECTED_FLOAT.get(name, {})
    unexplained = [(row.path, row.kind, row.reason) for row in report.layers if not (row.lookup or row.quantized)
                   and expected.get(row.path, "\0") not in row.reason]
    int8 = sum(row.quantized for row in report.layers if not row.lookup)
    assert not unexplained, f"{name}: float layers ({int8}/{int8 + len(unexplained)} INT8): {unexplained}\n{report}"
    fraction, floor = report.int8_mac_fraction, MAC_FLOORS.get(name, 1.0)
    assert fraction is not None and fraction >= floor, \
        f"{name}: int8_mac_fraction {fraction} is below the floor of {floor}\n{report}"


@pytest.mark.parametrize("name", _cases())
def test_int8_output_has_the_float_output_type(name: str) -> None:
    reference, out = _fresh_outputs(name)
    assert type(out) is type(reference), f"{name}: {type(out).__name__}, float: {type(reference).__name__}"
    if hasattr(out, "keys"):
        assert list(out.keys()) == list(reference.keys()), f"{name}: {list(out.keys())} vs {list(reference.keys())}"


DECODER_ONLY = {"gpt2", "opt", "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gpt_neox", "falcon"}


@pytest.mark.parametrize("name", _cases())
def test_the_default_scheme_is_dynamic_group_for_decoder_only_lms_and_static_elsewhere(name: str) -> None:
    scheme = quant_state(graph_of(_run(name).qmodel)).config.scheme
    assert scheme == ("dynamic_group" if name in DECODER_ONLY else "static"), (name, scheme)


def test_a_scheme_named_in_the_config_is_kept_for_a_decoder() -> None:
    model = hf_zoo.build("llama")
    for scheme in ("static", "dynamic", "dynamic_group", "weight_only"):
        assert fxquant.QuantConfig(scheme=scheme).for_model(model).scheme == scheme

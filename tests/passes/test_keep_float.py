"""``convert(keep_float=...)`` gives exactly the float computation for the kept region: the ops that were INT8 only
because their neighbours were (residual adds, SwiGLU's ``act(gate) * up``, pools and lookups between layers, the
quantizes feeding them) go float with the layers, so keeping every layer float is the prepared model, bit for bit,
while a partial choice leaves the other layers and the int8 ops between them INT8."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import fxquant
from fxquant.models import ZOO, create_model, example_inputs
from fxquant.nn.quantized import QuantizedLinear, _BackendModule
from fxquant.state import graph_of


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return _first(output[0])
    return next(value for value in output.values() if isinstance(value, torch.Tensor))  # a ModelOutput


def _int8_modules(qmodel: torch.nn.Module) -> Counter[str]:
    return Counter(type(m).__name__ for m in graph_of(qmodel).modules() if isinstance(m, _BackendModule))


def _calibrated(model: torch.nn.Module, example: tuple[Any, ...], data: list[Any],
                config: fxquant.QuantConfig | None = None) -> Any:
    prepared = fxquant.prepare(model, example, config)
    fxquant.calibrate(prepared, data, progress=False)
    return prepared


@pytest.mark.parametrize("name", list(ZOO))
def test_everything_kept_float_is_the_prepared_model(name: str) -> None:
    torch.manual_seed(0)
    model = create_model(name).eval()
    example = example_inputs(name, 2)
    prepared = _calibrated(model, example, [example_inputs(name, 2, seed=s) for s in (1, 2)])
    qmodel = fxquant.convert(prepared, keep_float=["*"])
    assert not _int8_modules(qmodel), _int8_modules(qmodel)
    x = example_inputs(name, 3, seed=7)
    with torch.no_grad():
        assert torch.equal(_first(qmodel(*x)), _first(prepared(*x)))


@pytest.fixture(scope="module")
def hf_zoo() -> Any:
    pytest.importorskip("transformers", reason="the optional 'transformers' extra is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import hf_zoo

    return hf_zoo


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "vit", "whisper_encoder"])
def test_everything_kept_float_is_the_prepared_hf_model(hf_zoo: Any, name: str) -> None:
    model = hf_zoo.build(name)
    data = hf_zoo.batches(name, 2)
    prepared = _calibrated(model, hf_zoo.positional(model, data[0]), data)
    qmodel = fxquant.convert(prepared, keep_float=["*"])
    assert not _int8_modules(qmodel), _int8_modules(qmodel)
    fresh = hf_zoo.positional(model, hf_zoo.batches(name, 1, seed=100)[0])
    with torch.inference_mode():
        assert torch.equal(hf_zoo.main_output(name, qmodel(*fresh)), hf_zoo.main_output(name, prepared(*fresh)))


def test_a_float_mlp_takes_its_product_along_and_attention_stays_int8(hf_zoo: Any) -> None:
    """Llama's SwiGLU MLPs kept float: ``act(gate) * up`` was INT8 (a QuantizedMul) only because gate/up/down were;
    it goes float with them, while every attention projection and the LM head stay INT8. Static W8A8 (named: a
    decoder's default is dynamic, whose layers read and return float, so no product between them is INT8)."""
    model = hf_zoo.build("llama")
    data = hf_zoo.batches("llama", 2)
    prepared = _calibrated(model, hf_zoo.positional(model, data[0]), data, fxquant.QuantConfig(scheme="static"))
    assert _int8_modules(fxquant.convert(prepared))["QuantizedMul"] == 2  # one per layer: the premise
    qmodel = fxquant.convert(prepared, keep_float=["*mlp*"])
    graph = graph_of(qmodel)
    assert not _int8_modules(qmodel)["QuantizedMul"]
    int8 = {path for path, m in graph.named_modules() if isinstance(m, QuantizedLinear)}
    attention = {path for path in int8 if "self_attn" in path}
    assert len(attention) == 8 and int8 - attention == {"model.lm_head.lm_head"}, sorted(int8)  # q, k, v, o x 2

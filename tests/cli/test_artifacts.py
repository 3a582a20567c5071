"""``fxquant.save`` / ``fxquant.load`` / ``fxquant.export`` in Python: round trips, tampering, refusal of pickles."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cli_testing import snapshot

import fxquant
from fxquant.artifacts import manifest as manifest_module
from fxquant.artifacts.manifest import checksum
from fxquant.errors import ArtifactError, InputError
from fxquant.kernels.registry import available_backends
from fxquant.models.digits import DigitsCNN, digits_cnn
from fxquant.state import quant_state

DATA = [torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _model() -> DigitsCNN:
    torch.manual_seed(0)
    return digits_cnn()


def _quantized(backend: str = "fbgemm", activation: str = "minmax") -> torch.fx.GraphModule:
    options = {"bins": 128} if activation == "histogram" else {}  # small histograms keep the test fast
    config = fxquant.QuantConfig(backend=backend, activation=activation, observer_options=options)
    prepared = fxquant.prepare(_model(), (DATA[0][:1],), config)
    fxquant.calibrate(prepared, DATA, progress=False)
    return fxquant.convert(prepared)


def _resign(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads((path / "manifest.json").read_text())
    data.pop("checksum")
    change(data)
    (path / "manifest.json").write_text(json.dumps({**data, "checksum": checksum(data)}))


@pytest.mark.parametrize("backend", [b for b in ("fbgemm", "reference", "onednn") if b in available_backends()])
def test_round_trip_gives_identical_outputs(tmp_path: Path, backend: str) -> None:
    qmodel = _quantized(backend, activation="histogram")
    fxquant.save(qmodel, tmp_path / "art")
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "art").iterdir()) == [
        "manifest.json", "observers", "quantized"]
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["stage"] == "converted" and manifest["backend"] == backend
    assert manifest["config"]["activation"] == "histogram" and manifest["torch_version"] == torch.__version__
    loaded = fxquant.load(tmp_path / "art", _model)  # a zero-argument factory works as well as a module
    x = torch.rand(7, 1, 8, 8)
    assert torch.equal(loaded(x), qmodel(x))


def test_layers_kept_float_at_convert_round_trip(tmp_path: Path) -> None:
    """Regression: ``convert(keep_float=...)`` (what an accuracy-budget search returns) was saved without its float
    layers, so loading rebuilt an all-INT8 graph and refused it as a changed model."""
    prepared = fxquant.prepare(_model(), (DATA[0][:1],), fxquant.QuantConfig(backend="reference"))
    fxquant.calibrate(prepared, DATA, progress=False)
    layers = [layer.path for layer in fxquant.coverage(prepared).layers if layer.path.startswith("fc")][:1]
    assert layers == ["fc1"], layers
    qmodel = fxquant.convert(prepared, keep_float=layers)
    fxquant.save(qmodel, tmp_path / "art")
    assert json.loads((tmp_path / "art" / "manifest.json").read_text())["keep_float"] == layers
    loaded = fxquant.load(tmp_path / "art", _model())
    x = torch.rand(5, 1, 8, 8)
    assert torch.equal(loaded(x), qmodel(x))
    assert not torch.equal(fxquant.convert(prepared)(x), qmodel(x))  # the float layer changes the output


def test_prepared_and_calibrated_models_round_trip(tmp_path: Path) -> None:
    prepared = fxquant.prepare(_model(), (DATA[0][:1],))
    fxquant.save(prepared, tmp_path / "p")
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["stage"] == "prepared"
    fxquant.calibrate(prepared, DATA, progress=False)
    fxquant.save(prepared, tmp_path / "c")
    restored = fxquant.load(tmp_path / "c", _model())
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(fxquant.convert(restored)(x), fxquant.convert(prepared)(x))


def test_resaving_replaces_the_artifact_and_a_failed_save_changes_nothing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "art"
    fxquant.save(_quantized(), path)
    first = snapshot(path)
    fxquant.save(_quantized(activation="moving_average"), path)
    assert len(snapshot(path)) == 3 and snapshot(path) != first  # old tensor files removed
    before = snapshot(path)

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(manifest_module, "atomic_write", crash)
    with pytest.raises(OSError, match="disk full"):
        fxquant.save(_quantized(backend="reference"), path)
    assert snapshot(path) == before


def test_tampered_files_are_detected(tmp_path: Path) -> None:
    fxquant.save(_quantized(), tmp_path / "art")
    quantized = next((tmp_path / "art").glob("quantized-*.pt"))
    quantized.write_bytes(quantized.read_bytes().replace(b"\x01", b"\x02", 1))
    with pytest.raises(ArtifactError, match="does not match the SHA-256"):
        fxquant.load(tmp_path / "art", _model())
    manifest = tmp_path / "art" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"minmax"', '"histogram"'))
    with pytest.raises(ArtifactError, match="modified after fxquant wrote it"):
        fxquant.load(tmp_path / "art", _model())
    manifest.write_text(manifest.read_text()[:100])
    with pytest.raises(ArtifactError, match="not valid JSON"):
        fxquant.load(tmp_path / "art", _model())


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_a_pickled_payload_is_refused_even_with_matching_hashes(tmp_path: Path) -> None:
    fxquant.save(_quantized(), tmp_path / "art")
    observers = next((tmp_path / "art").glob("observers-*.pt"))
    torch.save({"observer_0.min_val": _Payload(tmp_path / "code-ran")}, observers)
    data = observers.read_bytes()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    _resign(tmp_path / "art", lambda m: m["files"]["observers"].update(entry))
    with pytest.raises(ArtifactError, match="refused to load"):
        fxquant.load(tmp_path / "art", _model())
    assert not (tmp_path / "code-ran").exists()


def test_newer_format_is_refused(tmp_path: Path) -> None:
    fxquant.save(_quantized(), tmp_path / "art")
    _resign(tmp_path / "art", lambda m: m.update(format_version=2))
    with pytest.raises(ArtifactError, match=r"artifact format 2.*upgrade fxquant"):
        fxquant.load(tmp_path / "art", _model())


def test_wrong_weights_or_changed_graph_are_refused(tmp_path: Path) -> None:
    fxquant.save(_quantized(), tmp_path / "art")
    torch.manual_seed(1)
    with pytest.raises(ArtifactError, match="weights differ from those the artifact was made from"):
        fxquant.load(tmp_path / "art", digits_cnn())
    with pytest.raises(ArtifactError, match="graph no longer matches the artifact"):
        fxquant.load(tmp_path / "art", DigitsCNN(num_classes=12).eval())


def test_export_writes_torchscript_or_says_which_backend_cannot(tmp_path: Path) -> None:
    qmodel = _quantized("fbgemm")
    path = fxquant.export(qmodel, tmp_path / "model.pt")
    x = torch.rand(5, 1, 8, 8)
    assert torch.equal(torch.jit.load(str(path))(x), qmodel(x))
    with pytest.raises(InputError, match="takes a converted model"):
        fxquant.export(fxquant.prepare(_model(), (x,)), tmp_path / "p.pt")
    if "onednn" in available_backends():
        with pytest.raises(ArtifactError, match="'onednn' cannot be exported to TorchScript"):
            fxquant.export(_quantized("onednn"), tmp_path / "o.pt")
        assert not (tmp_path / "o.pt").exists()


def test_export_refuses_an_auto_model_with_onednn_layers(tmp_path: Path) -> None:
    """Checked before tracing: a trace of oneDNN primitives fxquant runs itself would record only empty outputs."""
    if "onednn" not in available_backends():
        pytest.skip("this torch has no onednn ops")
    prepared = fxquant.prepare(_model(), (DATA[0][:1],))
    fxquant.calibrate(prepared, DATA, progress=False)
    layers = quant_state(fxquant.convert(prepared, backend="auto")).layer_backends
    qmodel = fxquant.convert(prepared, backend="auto", layer_backends={name: "onednn" for name in layers})
    with pytest.raises(ArtifactError, match="'onednn' cannot be exported to TorchScript"):
        fxquant.export(qmodel, tmp_path / "auto.pt")
    assert not (tmp_path / "auto.pt").exists()


def test_models_with_int8_islands_round_trip(tmp_path: Path) -> None:
    """Observers nested inside untraceable blocks (partial tracing) are saved and restored too."""
    from fxquant.models import create_model, example_inputs

    model = create_model("control_flow")
    x = example_inputs("control_flow", 4)
    prepared = fxquant.prepare(model, x)
    fxquant.calibrate(prepared, [x], progress=False)
    with torch.no_grad():  # the data never takes the block's other branch: feed it directly
        prepared.gated.negative(torch.relu(prepared.stem(x[0])))
    qmodel = fxquant.convert(prepared)
    assert any("." in key.rpartition(".")[0] for key in qmodel.meta["fxquant_state"].observer_state)
    fxquant.save(qmodel, tmp_path / "art")
    assert torch.equal(fxquant.load(tmp_path / "art", model)(*x), qmodel(*x))

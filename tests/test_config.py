"""QuantConfig: validation messages, precedence, file round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxquant import QuantConfig
from fxquant.errors import ConfigError


def test_unknown_key_suggests_nearest_and_lists_valid() -> None:
    with pytest.raises(ConfigError, match=r"'activaton'.*Did you mean 'activation'.*Valid keys"):
        QuantConfig.from_dict({"activaton": "minmax"})


@pytest.mark.parametrize(("field", "value", "hint"), [
    ("backend", "fbgem", "fbgemm"), ("activation", "minmx", "minmax"), ("weight", "per_chanel", "per_channel")])
def test_bad_choice_names_the_nearest(field: str, value: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=f"Did you mean '{hint}'"):
        QuantConfig(**{field: value})


@pytest.mark.parametrize("value", ["conv", "Linear", 1, None])
def test_bias_correction_takes_linear_true_or_false(value: object) -> None:
    with pytest.raises(ConfigError, match=r"bias_correction=.*'linear' \(Linear layers, the default\), True"):
        QuantConfig(bias_correction=value)  # type: ignore[arg-type]
    for good in ("linear", True, False):
        assert QuantConfig.from_dict({"bias_correction": good}).bias_correction == good


def test_precedence_override_beats_exclude_beats_include() -> None:
    config = QuantConfig(include=["features.*", "head"], exclude=["features.1*"],
                         overrides={"features.10": {"activation": "minmax", "weight": "per_tensor"}})
    assert config.settings_for("features.0").quantize
    assert not config.settings_for("features.1").quantize
    assert config.settings_for("features.1").reason == "excluded by config"
    assert config.settings_for("features.10").quantize  # override wins over the exclude pattern
    assert config.settings_for("features.10").weight == "per_tensor"
    assert not config.settings_for("classifier").quantize
    assert "include" in config.settings_for("classifier").reason


def test_override_with_unknown_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"'weights' in overrides\['fc'\].*Did you mean 'weight'"):
        QuantConfig(overrides={"fc": {"weights": "per_tensor"}})


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_file_round_trip(tmp_path: Path, suffix: str) -> None:
    config = QuantConfig(backend="qnnpack", exclude=["fc"], overrides={"conv1": {"weight": "per_tensor"}})
    data = config.to_dict()
    path = tmp_path / f"fxquant{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    elif suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(data))
    else:
        path.write_text('version = 1\nbackend = "qnnpack"\nexclude = ["fc"]\n'
                        '[overrides.conv1]\nweight = "per_tensor"\n')
    loaded = QuantConfig.from_file(path)
    assert loaded.to_dict() == config.to_dict()


def test_unsupported_version_and_unparsable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="version 99"):
        QuantConfig.from_dict({"version": 99})
    bad = tmp_path / "c.yaml"
    bad.write_text("backend: [unclosed")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        QuantConfig.from_file(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        QuantConfig.from_file(tmp_path / "missing.json")


def test_a_bad_fxquant_isa_is_a_config_error_naming_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXQUANT_ISA", "avx1024")
    with pytest.raises(ConfigError, match="FXQUANT_ISA='avx1024' is not one of avx2, avx512, vnni, amx"):
        QuantConfig()

"""``QuantConfig``: one frozen dataclass that says what to quantize and how.

Patterns in ``include``/``exclude``/``overrides`` are fnmatch patterns on module paths (``features.*``), or
``type:<ClassName>`` to match every module of a class (``type:ConvTranspose2d``). Precedence for a module, decided
only in :meth:`QuantConfig.settings_for` and documented in the README: ``overrides`` (path patterns before type
patterns) > ``exclude`` > ``keep_first_float``/``keep_last_float`` > ``include`` > the defaults.

Configs round-trip through dicts, JSON, YAML and TOML with a version field; an unknown key raises
:class:`~fxquant.errors.ConfigError` naming the nearest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import nn

from fxquant.errors import ConfigError
from fxquant.native.isa import isa_cap

CONFIG_VERSION = 1
BACKENDS = ("fbgemm", "qnnpack", "onednn", "reference", "auto")
WEIGHT_SCHEMES = ("per_channel", "per_tensor")
# how a layer runs INT8 (docs/quantization.md "Schemes"): "static" W8A8 with calibrated activation ranges (int8 in
# and out); "dynamic" W8A8 with each row (token) of the input quantized at run time; "dynamic_group" likewise with
# one scale per 128 inputs of each row; "weight_only" INT8 weights with float activations (W8A16);
# "static_outliers" W8A8 with the input range calibrated over the ordinary tokens, a token outside it at its own
# scale. All but static read and return float and apply to Linear layers; all but the two static ones need no
# calibration.
SCHEMES = ("static", "dynamic", "dynamic_group", "weight_only", "static_outliers")
# QuantConfig.scheme may also be "auto" (the default): prepare() picks per model (QuantConfig.for_model)
AUTO_SCHEME = "auto"
CONFIG_SCHEMES = (AUTO_SCHEME, *SCHEMES)
UNOBSERVED = ("float", "error")  # what convert does with layers whose observers saw no data
OVERRIDE_KEYS = ("activation", "weight", "observer_options", "scheme")


def _unknown_key_error(key: str, valid: Sequence[str], where: str) -> ConfigError:
    near = difflib.get_close_matches(key, valid, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    return ConfigError(f"unknown key {key!r} in {where}.{hint} Valid keys: {', '.join(sorted(valid))}.")


def _decoder_only_lm(model: nn.Module) -> bool:
    """A transformers model that generates text from its own outputs alone (duck-typed: transformers is optional)."""
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    return callable(can_generate) and bool(can_generate()) and not getattr(config, "is_encoder_decoder", False)


def _check_choice(name: str, value: object, choices: Sequence[str], where: str) -> None:
    if value not in choices:
        near = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{where}: {name}={value!r} is not one of {', '.join(choices)}.{hint}")


def _check_activation(name: object, where: str) -> None:
    from fxquant.observers.registry import activation_observer_names  # lazy: config sits below observers

    if not isinstance(name, str):
        raise ConfigError(f"{where}: activation must be an observer name (str), got {type(name).__name__}")
    _check_choice("activation", name, activation_observer_names(), where)


def _default_backend() -> str:
    from fxquant.kernels.registry import default_backend  # lazy: which backends run is known only to the kernels

    return default_backend()


def _matches(pattern: str, path: str, module_type: str) -> bool:
    if pattern.startswith("type:"):
        return bool(module_type) and fnmatch.fnmatchcase(module_type, pattern[5:])
    return fnmatch.fnmatchcase(path, pattern)


@dataclass(frozen=True)
class LayerSettings:
    """The resolved settings for one module path."""

    quantize: bool
    activation: str
    weight: str
    observer_options: Mapping[str, Any]
    reason: str = ""
    scheme: str = "static"  # SCHEMES; a dynamic or weight-only Linear has quantize=False: it gets no observers


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model.

    Example::

        config = QuantConfig(backend="onednn", activation="histogram", exclude=["classifier.*"])
    """

    backend: str = field(default_factory=_default_backend)  # resolved when the config is made, so it is recorded
    activation: str = "histogram"  # the most accurate across the zoo and real data (docs/calibration.md)
    weight: str = "per_channel"
    # SCHEMES: static W8A8, dynamic W8A8 (per-token), dynamic_group (W8A8, per group of a token's inputs),
    # weight_only (W8A16); "auto": see for_model
    scheme: str = AUTO_SCHEME
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    observer_options: Mapping[str, Any] = field(default_factory=dict)
    leaf_modules: tuple[str, ...] = ()
    keep_first_float: bool = False
    keep_last_float: bool = False
    partial_tracing: bool = True
    smoothquant_alpha: float | str | None = None  # None (off), one alpha in [0, 1], or "auto" (one per layer)
    equalize: bool = False
    # "linear": every static Linear (the default: measured more accurate, at little calibration cost; docs/accuracy.md),
    # True: every static Linear and convolution, False: none
    bias_correction: bool | str = "linear"
    unobserved: str = "float"  # layers that never ran during calibration: "float" (warned) or "error"

    def __post_init__(self) -> None:
        for name in ("include", "exclude", "leaf_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise ConfigError(f"QuantConfig.{name} must be a list of patterns, got {value!r}")
            object.__setattr__(self, name, tuple(str(v) for v in value))
        isa_cap()  # a bad FXQUANT_ISA fails here, with the fix, before any kernel is picked by it
        _check_choice("backend", self.backend, BACKENDS, "QuantConfig")
        _check_choice("weight", self.weight, WEIGHT_SCHEMES, "QuantConfig")
        _check_choice("scheme", self.scheme, CONFIG_SCHEMES, "QuantConfig")
        _check_choice("unobserved", self.unobserved, UNOBSERVED, "QuantConfig")
        if not isinstance(self.bias_correction, bool) and self.bias_correction != "linear":
            raise ConfigError(f"QuantConfig: bias_correction={self.bias_correction!r} is not valid; use 'linear' "
                              "(Linear layers, the default), True (Linear layers and convolutions) or False (none)")
        _check_activation(self.activation, "QuantConfig")
        alpha = self.smoothquant_alpha
        is_number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
        if alpha is not None and alpha != "auto" and not (is_number and 0 <= alpha <= 1):  # type: ignore[operator]
            raise ConfigError(f"QuantConfig: smoothquant_alpha={alpha!r} is not valid; use None (off), a number in "
                              "[0, 1] (one alpha for every layer) or 'auto' (one alpha per layer, chosen on the "
                              "calibration data)")
        if not isinstance(self.overrides, Mapping):
            raise ConfigError(f"QuantConfig.overrides must map module paths to settings, got {self.overrides!r}")
        for path, settings in self.overrides.items():
            self._check_override(path, settings)

    @staticmethod
    def _check_override(path: str, settings: Mapping[str, Any]) -> None:
        where = f"overrides[{path!r}]"
        if not isinstance(settings, Mapping):
            raise ConfigError(f"{where} must be a mapping of settings, got {settings!r}")
        for key in settings:
            if key not in OVERRIDE_KEYS:
                raise _unknown_key_error(key, OVERRIDE_KEYS, where)
        if "activation" in settings:
            _check_activation(settings["activation"], where)
        if "weight" in settings:
            _check_choice("weight", settings["weight"], WEIGHT_SCHEMES, where)
        if "scheme" in settings:
            _check_choice("scheme", settings["scheme"], SCHEMES, where)

    def for_model(self, model: nn.Module) -> QuantConfig:
        """This config with ``scheme="auto"`` resolved for ``model`` (what ``prepare`` records):
        ``"dynamic_group"`` for a decoder-only language model (a Hugging Face model that generates and is not
        encoder-decoder: GPT-2, Llama, Qwen, ...), ``"static"`` for every other model.

        Why: a decoder's activations carry a few tokens (the first, punctuation: attention sinks) 10-1000x larger
        than the rest, so one calibrated range per tensor leaves the other tokens a handful of int8 steps; per-token
        scales give each token its own, and a scale per group of each token's inputs keeps its few outlier
        channels from costing the other channels their steps too, for a few percent more prefill time than per-token
        scales and less decode time (docs/quantization.md "Schemes" has the measurements).
        """
        if self.scheme != AUTO_SCHEME:
            return self
        return replace(self, scheme="dynamic_group" if _decoder_only_lm(model) else "static")

    def settings_for(self, path: str, module_type: str = "", *, position: str = "") -> LayerSettings:
        """Resolve the settings of the module at ``path`` of class ``module_type``.

        ``position`` is ``"first"``/``"last"`` for the first/last quantizable layer in graph order. Precedence:
        overrides (path, then type) > exclude > keep_first/last_float > include > defaults.
        """
        scheme = "static" if self.scheme == AUTO_SCHEME else self.scheme  # prepare() resolved it per model first
        base: dict[str, Any] = dict(activation=self.activation, weight=self.weight, scheme=scheme,
                                    observer_options=dict(self.observer_options))
        override = self._matching_override(path, module_type)
        if override is not None:
            merged = {**base, **override}
            merged["observer_options"] = {**base["observer_options"], **override.get("observer_options", {})}
            return LayerSettings(quantize=True, **merged)
        if any(_matches(p, path, module_type) for p in self.exclude):
            return LayerSettings(quantize=False, reason="excluded by config", **base)
        if (position == "first" and self.keep_first_float) or (position == "last" and self.keep_last_float):
            return LayerSettings(quantize=False, reason=f"{position} layer kept float by config", **base)
        if not any(_matches(p, path, module_type) for p in self.include):
            return LayerSettings(quantize=False, reason="not matched by config.include", **base)
        return LayerSettings(quantize=True, **base)

    def _matching_override(self, path: str, module_type: str) -> Mapping[str, Any] | None:
        if path in self.overrides:
            return self.overrides[path]
        by_path = [s for p, s in self.overrides.items() if not p.startswith("type:") and fnmatch.fnmatchcase(path, p)]
        by_type = [s for p, s in self.overrides.items() if p.startswith("type:") and _matches(p, path, module_type)]
        matches = by_path + by_type
        return matches[0] if matches else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with a ``version`` field."""
        data = dataclasses.asdict(self)
        for key in ("include", "exclude", "leaf_modules"):
            data[key] = list(data[key])
        data["overrides"] = {k: dict(v) for k, v in self.overrides.items()}
        data["observer_options"] = dict(self.observer_options)
        return {"version": CONFIG_VERSION, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> QuantConfig:
        """Build a config from a mapping; unknown keys raise ``ConfigError`` naming the nearest valid key."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ConfigError(f"{source}: config version {version!r} is not supported (this fxquant reads "
                              f"version {CONFIG_VERSION}); upgrade fxquant or rewrite the file")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in valid:
                raise _unknown_key_error(key, valid, source)
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_file(cls, path: str | Path) -> QuantConfig:
        """Read a ``.json``, ``.yaml``/``.yml`` or ``.toml`` config file."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        return cls.from_dict(_parse_config_text(path), source=str(path))


def _parse_config_text(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the tomli backport is a dependency there
                import tomli as tomllib  # type: ignore[no-redef]

            return tomllib.loads(text)
    except Exception as exc:  # each parser has its own error type; all mean the same to the user
        raise ConfigError(f"{path}: cannot parse {suffix[1:].upper()}: {exc}") from None
    raise ConfigError(f"{path}: unsupported config format {suffix!r}; use .json, .yaml, .yml or .toml")

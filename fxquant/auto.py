"""``backend="auto"``: pick kernels by measuring them on this CPU, on each layer's real shapes.

Backends come in two activation representations: quantized-dtype tensors (fbgemm, qnnpack) and plain uint8 tensors
(onednn, reference). Within one representation a layer can run on any member with no conversion, so each layer
takes the fastest member measured on its real input; across representations every switch would cost a copy, so
instead the whole model is built once per representation and the faster one (measured end to end, element-wise ops
included) is kept. Layer timings are cached per CPU, backend and shape for the life of the process.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import fx

from fxquant.cpu import cpu_model
from fxquant.errors import InputError
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.nn.quantized import _QuantizedWeighted

log = logging.getLogger(__name__)
FAMILIES = (("fbgemm", "qnnpack"), ("onednn",))
_CACHE: dict[tuple[Any, ...], float] = {}


def _fastest(candidates: dict[str, Callable[[], Any]], rounds: int = 15) -> dict[str, float]:
    """Best-of-``rounds`` milliseconds per candidate, measured round-robin so that load on a shared machine hits
    every candidate alike (the minimum is the least noisy estimate of a kernel's own speed)."""
    for fn in candidates.values():
        fn()  # warm-up: first calls fill caches and allocate
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


class _LayerInputs(fx.Interpreter):
    """Records the (int8) input of every quantized Linear/Conv while running the model once."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.inputs: dict[str, torch.Tensor] = {}

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(self.fetch_attr(target), _QuantizedWeighted):
            self.inputs[str(target)] = args[0]
        return super().call_module(target, args, kwargs)


def _compatible(module: _QuantizedWeighted, name: str) -> bool:
    """Whether ``module``'s input qparams fit what backend ``name`` needs (fbgemm's 7 bits for grouped convs)."""
    grouped = getattr(getattr(module, "spec", None), "groups", 1) > 1
    return module.in_qp.qmax <= get_backend(name).activation_qrange(feeds_grouped_conv=grouped)[1]


def _layer_key(module: _QuantizedWeighted, name: str, x: torch.Tensor) -> tuple[Any, ...]:
    return (cpu_model(), name, type(module).__name__, tuple(module.weight.shape), getattr(module, "spec", None),
            tuple(x.shape), torch.get_num_threads())


def _time_layer(module: _QuantizedWeighted, names: list[str], x: torch.Tensor) -> dict[str, float]:
    """Milliseconds of ``module`` on each backend in ``names`` for input ``x`` (cached per CPU, backend, shape)."""
    missing = [n for n in names if _layer_key(module, n, x) not in _CACHE]
    variants: dict[str, Callable[[], Any]] = {}
    for name in missing:
        variant = copy.copy(module)  # shares the int8 weight; only the prepacked kernel differs
        variant.relower(get_backend(name))
        variants[name] = partial(variant, x)
    for name, ms in _fastest(variants).items():
        _CACHE[_layer_key(module, name, x)] = ms
    return {n: _CACHE[_layer_key(module, n, x)] for n in names}


def _choose_layers(gm: fx.GraphModule, family: tuple[str, ...], example: tuple[Any, ...]) -> dict[str, str]:
    recorder = _LayerInputs(gm)
    with torch.inference_mode():
        recorder.run(*example)
        chosen = {}
        for path, x in recorder.inputs.items():
            module = gm.get_submodule(path)
            assert isinstance(module, _QuantizedWeighted)
            names = [name for name in family if _compatible(module, name)]
            times = _time_layer(module, names, x) if len(names) > 1 else {}
            chosen[path] = min(times, key=times.__getitem__) if times else module.backend.name
    return relower_layers(gm, chosen)


def relower_layers(gm: fx.GraphModule, choices: dict[str, str]) -> dict[str, str]:
    """Move each Linear/Conv named in ``choices`` to its backend there (same activation representation)."""
    modules = dict(gm.named_modules())
    for path, name in choices.items():
        module = modules.get(path)
        if not isinstance(module, _QuantizedWeighted):
            raise InputError(f"layer_backends names {path!r}, which is not a quantized Linear/Conv of this model; "
                             "record the choices from a conversion of the same model and configuration")
        if module.backend.name != name:
            module.relower(get_backend(name))
    return choices


def _families() -> Iterator[tuple[str, ...]]:
    available = set(available_backends())
    for family in FAMILIES:
        members = tuple(name for name in family if name in available)
        if members:
            yield members
    if not available & {name for family in FAMILIES for name in family}:
        yield ("reference",)


def family_of(choices: dict[str, str]) -> str | None:
    """The backend to lower a whole model with before ``relower_layers(choices)``: its family's first member."""
    return next((family[0] for family in FAMILIES if choices and set(choices.values()) <= set(family)), None)


def convert_auto(prepared: fx.GraphModule, lower: Callable[[fx.GraphModule, str], fx.GraphModule],
                 example: tuple[Any, ...]) -> tuple[fx.GraphModule, dict[str, str]]:
    """The fastest converted model over representations, each layer on its fastest backend; and the choices."""
    built: dict[str, tuple[fx.GraphModule, dict[str, str]]] = {}
    for family in _families():
        gm = lower(copy.deepcopy(prepared), family[0])
        built["+".join(family)] = (gm, _choose_layers(gm, family, example))
    with torch.inference_mode():
        times = _fastest({name: partial(gm, *example) for name, (gm, _) in built.items()}, rounds=5)
    for name, ms in times.items():
        log.info("fxquant auto: %s runs the model in %.3f ms", name, ms)
    return built[min(times, key=times.__getitem__)]

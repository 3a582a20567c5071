"""``backend="auto"``: pick kernels by measuring whole models on this CPU, on the deployment inputs.

Backends come in two activation representations: quantized-dtype tensors (fbgemm, qnnpack) and plain uint8 tensors
(onednn, reference). Within one representation a layer can run on any member with no conversion, so per-layer
timings (cached per CPU, backend and shape for the life of the process) propose a mix: each layer on the member
that ran its real input fastest. Layer timings alone can mislead (they miss what a member gains across layers, such
as onednn's replayed runs of layers, and one noisy layer skews the mix), so they only propose: the final pick is
among whole models timed side by side on the same inputs, namely every available backend alone and each family's
mix where it differs from all of them. Auto therefore never keeps a model measured slower than a single backend it
could have used for the whole model.
"""

from __future__ import annotations

import copy
import gc
import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import fx

from fxquant.errors import InputError
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.native.isa import cpu_model
from fxquant.nn.quantized import _QuantizedWeighted
from fxquant.runtime import runner

log = logging.getLogger(__name__)
FAMILIES = (("fbgemm", "qnnpack"), ("onednn",))
MODEL_ROUNDS = 7  # odd: the median is one measured call
_CACHE: dict[tuple[Any, ...], float] = {}

Lower = Callable[[fx.GraphModule, str], fx.GraphModule]


class Candidate(NamedTuple):
    """One whole converted model auto may return, and its per-layer backends (what ``relower_layers`` replays)."""

    model: fx.GraphModule
    choices: dict[str, str]


def _fastest(candidates: Mapping[str, Callable[[], Any]], rounds: int = 15,
             estimate: Callable[[list[float]], float] = min) -> dict[str, float]:
    """``estimate`` of each candidate's milliseconds over ``rounds`` rounds, each round calling every candidate once.

    Interleaving makes load on a shared machine hit every candidate alike, and the order is shuffled per round
    (with a fixed seed, so runs are repeatable and the global RNG is untouched) so that no candidate always runs
    right after the same one, whose cache footprint or allocator state it would inherit.
    """
    for fn in candidates.values():
        fn()  # warm-up: first calls fill caches, allocate and bind kernels to the input shapes
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    order, shuffle = list(candidates), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            candidates[name]()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: estimate(times) for name, times in samples.items()}


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
    """Milliseconds of ``module`` on each backend in ``names`` for input ``x`` (cached per CPU, backend, shape).

    The minimum of rounds: a single kernel call is short, so its fastest call is the least noisy estimate of the
    kernel's own speed."""
    missing = [n for n in names if _layer_key(module, n, x) not in _CACHE]
    variants: dict[str, Callable[[], Any]] = {}
    for name in missing:
        variant = copy.copy(module)  # shares the int8 weight; only the prepacked kernel differs
        variant.relower(get_backend(name))
        variants[name] = partial(variant, x)
    for name, ms in _fastest(variants).items():
        _CACHE[_layer_key(module, name, x)] = ms
    return {n: _CACHE[_layer_key(module, n, x)] for n in names}


def _weighted(gm: fx.GraphModule) -> dict[str, _QuantizedWeighted]:
    return {path: m for path, m in gm.named_modules() if isinstance(m, _QuantizedWeighted)}


def _everywhere(gm: fx.GraphModule, name: str) -> dict[str, str]:
    """Every Linear/Conv of ``gm`` on backend ``name``, except layers whose input qparams it cannot take."""
    return {path: name if _compatible(m, name) else m.backend.name for path, m in _weighted(gm).items()}


def _per_layer(gm: fx.GraphModule, family: tuple[str, ...], example: tuple[Any, ...]) -> dict[str, str]:
    """Each Linear/Conv of ``gm`` on the member of ``family`` that ran its input from ``example`` fastest."""
    recorder = _LayerInputs(gm)
    with torch.inference_mode():
        recorder.run(*example)
        chosen = {path: m.backend.name for path, m in _weighted(gm).items()}  # layers the run did not reach stay
        for path, x in recorder.inputs.items():
            module = gm.get_submodule(path)
            assert isinstance(module, _QuantizedWeighted)
            names = [name for name in family if _compatible(module, name)]
            times = _time_layer(module, names, x) if len(names) > 1 else {}
            if times:
                chosen[path] = min(times, key=times.__getitem__)
    return chosen


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


def mix_name(family: tuple[str, ...]) -> str:
    """How logs name ``family``'s per-layer mix among the whole-model candidates."""
    return f"{'+'.join(family)} per layer"


def _family_candidates(prepared: fx.GraphModule, lower: Lower, family: tuple[str, ...],
                       example: tuple[Any, ...]) -> dict[str, Candidate]:
    """Each member of ``family`` alone, and the per-layer mix unless it equals one of them.

    Every candidate is lowered with the family's first member and re-lowered per layer, exactly as a replay of its
    choices rebuilds it (``family_of`` + ``relower_layers``), so a saved auto model loads as it was timed. qnnpack
    alone thus runs qnnpack's kernels on fbgemm's qparams (7-bit inputs to grouped convs): the speed of
    ``backend="qnnpack"``, whose outputs differ only where those inputs do."""
    base = lower(copy.deepcopy(prepared), family[0])
    proposals = {name: _everywhere(base, name) for name in family}
    proposals[mix_name(family)] = _per_layer(base, family, example)
    candidates: dict[str, Candidate] = {}
    for name, choices in proposals.items():
        if any(choices == kept.choices for kept in candidates.values()):
            continue  # the same model as a candidate already built: built and timed once
        gm = base if not candidates else lower(copy.deepcopy(prepared), family[0])
        relower_layers(gm, choices)
        candidates[name] = Candidate(runner.install(gm), choices)  # timed as callers run it
    return candidates


def _time_models(models: dict[str, fx.GraphModule], example: tuple[Any, ...]) -> dict[str, float]:
    """Median milliseconds of each whole model on ``example``, over ``MODEL_ROUNDS`` interleaved rounds.

    The median, not the minimum: a whole model runs many kernels, and on a loaded machine the spread between its
    calls is wide, so its single fastest call says how lucky one call was rather than how fast the model usually
    runs, and a noisy candidate could win on one such call. Each round times every model within a short window, so
    the median of rounds compares the models under the same load."""
    with torch.inference_mode():
        calls = {name: partial(gm, *example) for name, gm in models.items()}
        return _fastest(calls, rounds=MODEL_ROUNDS, estimate=statistics.median)


def convert_auto(prepared: fx.GraphModule, lower: Lower, example: tuple[Any, ...]
                 ) -> tuple[fx.GraphModule, dict[str, str]]:
    """The fastest whole converted model among the candidates, measured on ``example``; and its per-layer choices.

    ``lower(gm, backend)`` converts a deep copy of ``prepared`` for one backend. Up to one model per available
    backend plus one mix per family is alive while timing; the losers are dropped before returning."""
    candidates: dict[str, Candidate] = {}
    for family in _families():
        candidates.update(_family_candidates(prepared, lower, family, example))
    if len(candidates) == 1:
        name = next(iter(candidates))
        log.info("fxquant auto: %s is the only candidate; nothing timed", name)
        return candidates[name]
    times = _time_models({name: c.model for name, c in candidates.items()}, example)
    best = min(times, key=times.__getitem__)
    log.info("fxquant auto: whole models timed, median of %d interleaved rounds: %s; kept %s", MODEL_ROUNDS,
             ", ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(times.items(), key=lambda item: item[1])), best)
    winner = candidates.pop(best)
    candidates.clear()
    gc.collect()  # a GraphModule is a reference cycle (its graph points back to it): free the losers now
    return winner

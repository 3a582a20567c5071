"""Hypothesis strategies for the robustness tests: random valid models (as ``ModelSpec``) and calibration data.

``model_specs()`` grows a DAG one op at a time from the values built so far (preferring the newest, so models are
mostly deep, with skips); ``residual`` and ``branch`` blocks add shape-preserving layers joined back by add/mul/cat.
Every draw keeps shapes valid by construction (``spec_model.out_shape`` is the one shape rule), so a generated model
always runs in float; what is tested is fxquant, not the generator. ``data_specs()`` picks a distribution, a scale
from 1e-3 to 1e3 and constant input channels; ``batches`` turns it into tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from spec_model import ModelSpec, Op, Shape, conv_length, out_shape

from fxquant.nn.quantized import QuantizedLinear

MAX_CHANNELS = 16
MAX_FEATURES = 48
DISTRIBUTIONS = ("normal", "uniform", "heavy_tailed", "one_sided")


def profile(fraction: float = 1.0) -> settings:
    """The active hypothesis profile (``HYPOTHESIS_PROFILE``, default ``robustness``; see conftest.py), with its
    number of examples scaled by ``fraction`` (below 1 for costly tests, above 1 for the main property)."""
    base = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "robustness"))
    return settings(base, max_examples=max(1, round(base.max_examples * fraction)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def quantized_linear(qmodel: torch.nn.Module, path: str) -> QuantizedLinear:
    """The converted Linear at ``path`` (typed, for its qparams)."""
    layer = qmodel.get_submodule(path)
    assert isinstance(layer, QuantizedLinear), f"{path} is a {type(layer).__name__}"
    return layer


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def input_shapes(draw: st.DrawFn) -> Shape:
    rank = draw(st.sampled_from([3, 2, 1]))
    if rank == 1:
        return (draw(st.integers(1, 32)),)
    channels = draw(st.integers(1, 8))
    return (channels, *(draw(st.integers(1, 10)) for _ in range(rank - 1)))


@st.composite
def conv_ops(draw: st.DrawFn, src: int, shape: Shape, *, keep_size: bool = False, out: int | None = None) -> Op:
    """A Conv1d/Conv2d on ``shape``; ``keep_size``: stride 1 and "same" padding (for residual blocks)."""
    channels, sizes = shape[0], shape[1:]
    groups = draw(st.sampled_from(_divisors(channels)))
    if out is None:
        multiplier = draw(st.integers(1, max(1, MAX_CHANNELS // groups)))
        out = groups * multiplier if groups < channels else channels * draw(st.integers(1, 2))  # depthwise x1/x2
    if keep_size:
        kernel = draw(st.sampled_from([1, 3]))
        return Op("conv", (src,), (out, kernel, 1, kernel // 2, 1, groups, draw(st.booleans())), _form(draw))
    padding, dilation = draw(st.integers(0, 2)), draw(st.integers(1, 2))
    largest = min((s + 2 * padding - 1) // dilation + 1 for s in sizes)
    kernel = draw(st.integers(1, max(1, min(5, largest))))
    stride = draw(st.integers(1, 3))
    assert all(conv_length(s, kernel, stride, padding, dilation) >= 1 for s in sizes)
    return Op("conv", (src,), (out, kernel, stride, padding, dilation, groups, draw(st.booleans())), _form(draw))


def _form(draw: st.DrawFn) -> str:
    return draw(st.sampled_from(["module", "functional"]))


@st.composite
def linear_ops(draw: st.DrawFn, src: int, shape: Shape, *, out: int | None = None) -> Op:
    features = out if out is not None else draw(st.integers(1, MAX_FEATURES))
    return Op("linear", (src,), (features, draw(st.booleans())), _form(draw))


def compute_ops(src: int, shape: Shape, *, keep_size: bool = False, out: int | None = None
                ) -> st.SearchStrategy[Op]:
    """A Linear (on the last dim) or, for (C, L) and (C, H, W) values, a Conv1d/Conv2d."""
    if len(shape) == 1:
        return linear_ops(src, shape, out=out)
    convs = conv_ops(src, shape, keep_size=keep_size, out=out)
    return convs if keep_size or out is not None else st.one_of(convs, linear_ops(src, shape))


@st.composite
def activation_ops(draw: st.DrawFn, src: int) -> Op:
    name = draw(st.sampled_from(["relu", "relu6", "hardtanh", "gelu", "sigmoid"]))
    forms = ["module", "functional", "method"] if name == "relu" else ["module", "functional"]
    return Op("act", (src,), (name,), draw(st.sampled_from(forms)))


@st.composite
def pool_ops(draw: st.DrawFn, src: int, shape: Shape) -> Op:
    name = draw(st.sampled_from(["max", "avg", "adaptive"]))
    form = _form(draw)
    if name == "adaptive":
        return Op("pool", (src,), (name, draw(st.integers(1, 2)), 1, 0), form)
    kernel = draw(st.integers(1, min(3, *shape[1:])))
    padding = draw(st.integers(0, kernel // 2))
    return Op("pool", (src,), (name, kernel, draw(st.integers(1, 2)), padding), form)


@st.composite
def reshape_ops(draw: st.DrawFn, src: int, shape: Shape) -> Op:
    """(F,) -> (c, F/c), (C, L) -> (C, h, L/h) or (C, H, W) -> (C, H*W)."""
    if len(shape) == 3:
        target: Shape = (shape[0], shape[1] * shape[2])
    else:
        size = shape[-1]
        factor = draw(st.sampled_from(_divisors(size)))
        target = (factor, size // factor) if len(shape) == 1 else (shape[0], factor, size // factor)
    return Op("reshape", (src,), (target,), draw(st.sampled_from(["method", "view", "function"])))


@st.composite
def block(draw: st.DrawFn, src: int, shape: Shape, first: int) -> list[Op]:
    """Ops appended after value ``first - 1``: one layer, or a residual/branch block joined back to ``src``."""
    kind = draw(st.sampled_from(["compute", "compute", "residual", "branch", "bn", "act", "pool", "flatten",
                                 "reshape"]))
    if kind == "residual":
        layer = draw(compute_ops(src, shape, keep_size=True, out=shape[0]))
        ops = [layer, *([draw(activation_ops(first))] if draw(st.booleans()) else [])]
        join = draw(st.sampled_from(["add", "add", "mul"]))
        args = (draw(st.booleans()),) if join == "add" else ()
        return [*ops, Op(join, (src, first + len(ops) - 1), args, draw(st.sampled_from(["operator", "torch"])))]
    if kind == "branch":
        layer = draw(conv_ops(src, shape, keep_size=True) if len(shape) > 1 else linear_ops(src, shape))
        return [layer, Op("cat", (src, first), (), "torch")]
    if kind == "bn" and len(shape) > 1:
        return [Op("bn", (src,), (draw(st.integers(0, 2**16)),), _form(draw))]
    if kind == "act":
        return [draw(activation_ops(src))]
    if kind == "pool" and len(shape) > 1:
        return [draw(pool_ops(src, shape))]
    if kind == "flatten" and len(shape) > 1:
        form = draw(st.sampled_from(["module", "function", "method", "view", "reshape"]))
        return [Op("flatten", (src,), (), form)]
    if kind == "reshape":
        return [draw(reshape_ops(src, shape))]
    return [draw(compute_ops(src, shape))]


@st.composite
def model_specs(draw: st.DrawFn, max_blocks: int = 5) -> ModelSpec:
    """A random valid model: a chain of blocks, each reading one of the three newest values."""
    shapes = [draw(input_shapes())]
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, max_blocks))):
        src = len(shapes) - 1 - draw(st.integers(0, min(2, len(shapes) - 1)))
        for op in draw(block(src, shapes[src], len(shapes))):
            ops.append(op)
            shapes.append(out_shape(op, [shapes[i] for i in op.src]))
    if not any(op.kind in ("conv", "linear") for op in ops):
        ops.append(draw(compute_ops(len(shapes) - 1, shapes[-1])))
    return ModelSpec(shapes[0], tuple(ops), draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class DataSpec:
    """Calibration/evaluation data: ``scale * distribution`` with ``constant_channels`` fixed input channels."""

    distribution: str = "normal"
    scale: float = 1.0
    constant_channels: int = 0
    batch: int = 2
    seed: int = 0


def data_specs() -> st.SearchStrategy[DataSpec]:
    return st.builds(DataSpec, st.sampled_from(DISTRIBUTIONS), st.floats(-3.0, 3.0).map(lambda e: 10.0**e),
                     st.integers(0, 2), st.integers(1, 4), st.integers(0, 2**16))


def batches(model: ModelSpec, data: DataSpec, count: int, *, offset: int = 0) -> list[torch.Tensor]:
    """``count`` batches of ``model``'s input; ``offset`` gives other batches of the same distribution."""
    rng = np.random.default_rng(data.seed)
    constants = rng.normal(size=data.constant_channels)
    rng = np.random.default_rng([data.seed, offset])
    shape = (data.batch, *model.input_shape)
    draw = {"normal": lambda: rng.normal(size=shape), "uniform": lambda: rng.uniform(-1.0, 3.0, size=shape),
            "heavy_tailed": lambda: rng.standard_t(1.5, size=shape),
            "one_sided": lambda: np.maximum(rng.normal(size=shape), 0.0)}[data.distribution]
    out = []
    for _ in range(count):
        values = draw()
        for channel, constant in enumerate(constants[: model.input_shape[0]]):
            values[:, channel] = constant
        out.append(torch.from_numpy(values * data.scale).float())
    return out


@st.composite
def observer_batches(draw: st.DrawFn) -> list[torch.Tensor]:
    """1-4 float32 batches of one of ``DISTRIBUTIONS`` (or constant) at a scale from 1e-3 to 1e3."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from([*DISTRIBUTIONS, "constant"]))
    scale = 10.0 ** draw(st.floats(-3.0, 3.0))
    out = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 600))
        values = {"normal": lambda n=n: rng.normal(size=n), "uniform": lambda n=n: rng.uniform(-1.0, 3.0, size=n),
                  "heavy_tailed": lambda n=n: rng.standard_t(1.5, size=n),
                  "one_sided": lambda n=n: np.maximum(rng.normal(size=n), 0.0),
                  "constant": lambda n=n: np.full(n, 0.7)}[kind]()
        out.append(torch.from_numpy(values * scale).float())
    return out

"""oneDNN int8 primitives called directly (the ``_dnnl`` C extension, ``fxquant/kernels/onednn/csrc/``): built once
per layer, input shape and thread count.

torch 2.13's plain-tensor ops rebuild oneDNN's primitive descriptor, scale and zero-point memories and scratchpad on
every call, which at batch 1 costs more than the kernel itself on small layers; a primitive built here once runs the
same kernel with two data pointers set (the measurements are in docs/backends.md, "Layers on oneDNN primitives built
once"). The results are bit-identical to the ops' (tests/kernels/test_onednn_direct.py): the same oneDNN
algorithms, scales, zero points and post-ops.

The library comes from Intel's ``onednn-cpu-gomp`` wheel (a dependency of fxquant on x86-64 Linux; it installs
``libdnnl.so.3`` under ``sys.prefix/lib``) or from ``FXQUANT_DNNL_LIBRARY`` (a path; ``0`` turns the direct path
off). It runs on torch's own OpenMP runtime (``libgomp.so.1``, loaded with torch), so ``torch.set_num_threads``
governs it; a process where it would get a second runtime keeps the torch ops. Without it, the onednn backend calls
the torch ops: same results, more time per call.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fxquant.kernels import recording
from fxquant.kernels.base import ConvSpec

_dnnl: ModuleType | None
try:
    from fxquant.kernels.onednn import _dnnl
except ImportError:  # built without a C compiler
    _dnnl = None

LIBRARY_ENV = "FXQUANT_DNNL_LIBRARY"
_ELTWISE = {"relu": (32, 0.0, 0.0), "silu": (44, 1.0, 0.0), "hardswish": (52, 1.0 / 6.0, 0.5),
            "gelu": (49, 0.0, 0.0), "gelu_tanh": (43, 0.0, 0.0)}  # dnnl_eltwise_* (oneDNN v3) and alpha, beta
_CLIP = 46  # dnnl_eltwise_clip: alpha and beta are the bounds
_MEMORY_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
Clip = tuple[float, float]  # (low, high) of a clip post-op, in the float domain before the output's quantization
Output = tuple[float, int, torch.dtype]  # (scale, zero point, dtype) of a result; float32 results: (1.0, 0, float32)
# The int8 weight a primitive is built from: the dense plain tensor, or, for a layer whose primitives hold its only
# copy, a function making the plain tensor anew (see ``_primitive``)
Weight = torch.Tensor | Callable[[], torch.Tensor]


def _candidates() -> list[str]:
    configured = os.environ.get(LIBRARY_ENV)
    if configured is not None:
        return [] if configured in ("", "0") else [configured]
    found = ctypes.util.find_library("dnnl")
    return [str(Path(sys.prefix, "lib", "libdnnl.so.3")), *([found] if found else [])]


def _gomp_runtimes() -> set[str]:
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:  # not Linux: no way to check, trust the soname
        return set()


@functools.cache
def status() -> str:
    """Which oneDNN the onednn backend calls directly, or why it calls the torch ops (reports record it under
    ``environment.onednn``)."""
    if _dnnl is None:
        return "off: fxquant was built without its C extension"
    if os.environ.get(LIBRARY_ENV) in ("", "0"):
        return f"off: {LIBRARY_ENV}={os.environ[LIBRARY_ENV]}"
    reasons = []
    for path in _candidates():
        runtimes = _gomp_runtimes()
        try:
            major, minor, patch = _dnnl.load(path)
        except OSError as error:
            reasons.append(str(error))
            continue
        if len(_gomp_runtimes() - runtimes) > 0:
            return f"off: {path} brought a second OpenMP runtime (threads would not follow torch.set_num_threads)"
        return f"oneDNN {major}.{minor}.{patch} from {path}"
    return "off: " + ("; ".join(reasons) or "no libdnnl.so.3 (pip install onednn-cpu-gomp)")


def available() -> bool:
    """Whether layers run on directly called oneDNN primitives."""
    return status().startswith("oneDNN")


def _strides(shape: tuple[int, ...], memory_format: torch.memory_format) -> list[int]:
    return list(torch.empty(shape, dtype=torch.uint8, device="meta", memory_format=memory_format).stride())


def uint8_input(a: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``a`` laid out as the primitive reads it; the primitive reads raw bytes, so another dtype is refused here."""
    if a.dtype is not torch.uint8:
        raise TypeError(f"oneDNN int8 layers take uint8 activations, got {a.dtype}")
    return a if a.is_contiguous(memory_format=memory_format) else a.contiguous(memory_format=memory_format)


def _eltwise(post_op: str, clip: Clip | None) -> tuple[tuple[int, float, float], ...]:
    named = () if post_op == "none" else (_ELTWISE[post_op],)
    return named if clip is None else (*named, (_CLIP, *clip))


def _primitive(weight: Weight, weight_dims: list[int], src_dims: list[int], src_strides: list[int],
               dst_dims: list[int], dst_strides: list[int], scales: torch.Tensor, bias: torch.Tensor | None,
               x_qp: tuple[float, int], output: Output, geometry: tuple[list[int], ...] | None, post_op: str,
               clip: Clip | None, accum_qp: tuple[float, int] | None, shared: list[Any]) -> Any:
    """A ``_dnnl.Primitive``, or None where this oneDNN has no implementation for it (the caller then runs the
    torch op, whose newer oneDNN may have one). ``shared``: the layer's primitives that own their reordered weights
    (one per layout); a new one uses those of the layout oneDNN picks for its input shape and thread count, if
    there, and joins the list otherwise, so a layer run at several batch sizes mostly holds one copy. ``weight``
    given as a function (the layer keeps no plain copy): the plain weight is made only where no primitive in
    ``shared`` has the layout, for the reorder, and dropped after it."""
    assert _dnnl is not None
    arguments = (weight_dims, src_dims, src_strides, dst_dims, dst_strides,
                 "f32" if output[2] == torch.float32 else "u8", scales.to(torch.float32).numpy().tobytes(),
                 None if bias is None else bias.to(torch.float32).numpy().tobytes(), *x_qp, *output[:2], geometry,
                 _eltwise(post_op, clip), accum_qp, shared)
    try:
        try:
            primitive = _dnnl.Primitive(None if callable(weight) else weight.data_ptr(), *arguments)
        except LookupError:  # only raised for a function: no shared layout fits
            assert callable(weight)
            plain = weight()
            primitive = _dnnl.Primitive(plain.data_ptr(), *arguments)
    except RuntimeError:
        return None
    if all(primitive.weights_address != owner.weights_address for owner in shared):
        shared.append(primitive)
    return primitive


def conv(weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec,
         shape: tuple[int, ...], out_shape: tuple[int, ...], x_qp: tuple[float, int], output: Output, post_op: str,
         shared: list[Any], accum_qp: tuple[float, int] | None = None,
         clip: Clip | None = None) -> Callable[..., torch.Tensor] | None:
    """A call ``f(a)`` (or ``f(a, accum)`` with ``accum_qp``: the sum post-op) running this conv on channels-last
    uint8 inputs of ``shape``; ``weight``: plain int8 (O, I/groups, k...); ``output``: the result's (scale, zero
    point, dtype); ``post_op``: a name in ``_ELTWISE`` or ``"none"``, applied to the float result; ``clip``: float
    bounds the result is clipped to after it; ``shared``: see ``_primitive``. None where this oneDNN cannot run it."""
    memory_format = _MEMORY_FORMATS[len(shape)]
    out_strides = _strides(out_shape, memory_format)
    dims = list(weight.shape)
    if spec.groups > 1:
        dims = [spec.groups, dims[0] // spec.groups, *dims[1:]]
    geometry = (list(spec.stride), [d - 1 for d in spec.dilation], list(spec.padding), list(spec.padding))
    primitive = _primitive(weight, dims, list(shape), _strides(shape, memory_format), list(out_shape), out_strides,
                           scales, bias, x_qp, output, geometry, post_op, clip, accum_qp, shared)
    if primitive is None:
        return None
    chosen = conv_call(primitive.run, out_shape, output[2], accum_qp is not None)
    chosen.primitive = primitive  # type: ignore[attr-defined]  # for inspection (tests, debugging)
    return chosen


def conv_call(run: recording.AddressCall, out_shape: tuple[int, ...], dtype: torch.dtype,
              summed: bool) -> Callable[..., torch.Tensor]:
    """A conv's call ``f(a)`` (``f(a, accum)`` where ``summed``: the sum post-op) around ``run(input address, output
    address)``, which computes the channels-last output of ``out_shape`` from the channels-last uint8 input: fxquant's
    primitives and its AVX2 conv loops alike. The call is logged for a replay (:mod:`fxquant.kernels.recording`)."""
    memory_format = _MEMORY_FORMATS[len(out_shape)]
    out_strides, empty = _strides(out_shape, memory_format), torch.empty_strided

    def call(a: torch.Tensor) -> torch.Tensor:
        a = uint8_input(a, memory_format)
        out = empty(out_shape, out_strides, dtype=dtype)
        run(a.data_ptr(), out.data_ptr())
        recording.record(run, a.data_ptr(), out)
        return out

    def call_sum(a: torch.Tensor, accum: torch.Tensor) -> torch.Tensor:
        # oneDNN reads the accumulator from the destination and overwrites it, as the torch op does (the graph copies
        # an accumulator that is read later: QuantizedConvAdd2d.clone_accum)
        a, out = uint8_input(a, memory_format), uint8_input(accum, memory_format)  # held: run() reads them
        run(a.data_ptr(), out.data_ptr())
        recording.record(run, a.data_ptr(), out)
        return out

    return call_sum if summed else call


def linear(weight: Weight, out_features: int, scales: torch.Tensor, bias: torch.Tensor | None,
           shape: tuple[int, ...], x_qp: tuple[float, int], output: Output, post_op: str,
           shared: list[Any], clip: Clip | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A call ``f(a)`` running this Linear on uint8 inputs of ``shape`` (..., in_features); ``weight``: plain int8
    (out_features, in_features), or a function making it (see ``_primitive``); other arguments and None as
    ``conv``."""
    rows, in_features = shape[:-1], shape[-1]
    m = 1
    for size in rows:
        m *= size
    primitive = _primitive(weight, [out_features, in_features], [m, in_features], [in_features, 1],
                           [m, out_features], [out_features, 1], scales, bias, x_qp, output, None, post_op, clip,
                           None, shared)
    if primitive is None:
        return None
    run, empty, dtype, out_shape = primitive.run, torch.empty, output[2], (*rows, out_features)

    def call(a: torch.Tensor) -> torch.Tensor:
        a = uint8_input(a, torch.contiguous_format)
        out = empty(out_shape, dtype=dtype)
        run(a.data_ptr(), out.data_ptr())
        recording.record(run, a.data_ptr(), out)
        return out

    call.primitive = primitive  # type: ignore[attr-defined]
    return call

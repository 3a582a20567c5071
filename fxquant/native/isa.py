"""What this CPU can do, read once: which int8 instruction sets the kernels can use.

``FXQUANT_ISA`` caps what fxquant assumes (``avx2``, ``avx512``, ``vnni`` or ``amx``; unset: what the CPU has), so
one machine can run the paths of a smaller one: ``FXQUANT_ISA=avx512`` takes AVX512-VNNI and AMX away (7-bit
activations for fbgemm/oneDNN, the engines' kernels instead of the VNNI/AMX loops), ``vnni`` takes AMX away. The C
loops read the cap when :mod:`fxquant.native` loads; the Python checks read it on every call. Set oneDNN's own
``ONEDNN_MAX_CPU_ISA`` to match (docs/backends.md), since oneDNN picks its kernels by itself.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from fxquant.errors import ConfigError

ISA_ENV = "FXQUANT_ISA"
ISA_LEVELS = ("avx2", "avx512", "vnni", "amx")  # each level includes the ones before it
# the flags that make a level: all of a set, any of the sets (AVX-VNNI gives client CPUs 32-bit int8 sums too)
_LEVEL_FLAGS = {"avx2": ({"avx2"},), "avx512": ({"avx512f", "avx512bw"},),
                "vnni": ({"avx512_vnni"}, {"avx_vnni"}), "amx": ({"amx_int8", "amx_tile"},)}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_cap(*, strict: bool = True) -> int:
    """The index in :data:`ISA_LEVELS` of the highest level ``FXQUANT_ISA`` allows (the last one when unset).

    A value that is not a level raises ``ConfigError``; with ``strict=False`` (the C loops' cap, read while
    ``import fxquant`` runs, where an exception would be a traceback) it is the lowest level instead, and the
    error comes from the first Python check, inside the caller's own error handling."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return len(ISA_LEVELS) - 1
    if value not in ISA_LEVELS:
        if not strict:
            return 0
        raise ConfigError(f"{ISA_ENV}={value!r} is not one of {', '.join(ISA_LEVELS)}; unset it to use every "
                          "instruction set this CPU has")
    return ISA_LEVELS.index(value)


def _allows(level: str) -> bool:
    """Whether the cap admits ``level`` and the CPU has its instructions."""
    flags = _cpu_flags()
    return ISA_LEVELS.index(level) <= isa_cap() and any(needed <= flags for needed in _LEVEL_FLAGS[level])


def has_avx2() -> bool:
    """AVX2: the few-row Linear loop of CPUs without VNNI (fbgemm's pairwise 16-bit sums, exact on 7-bit inputs)."""
    return _allows("avx2")


def has_avx512_vnni() -> bool:
    """AVX512-VNNI itself, which the C loops' VNNI forms need: a CPU with AVX-VNNI alone sums int8 exactly (so its
    activations are 8-bit) but runs neither those loops nor, being a VNNI CPU, the AVX2 row loop."""
    return _allows("vnni") and {"avx512_vnni", "avx512bw"} <= _cpu_flags()


def has_avx512() -> bool:
    """AVX512F and BW: the byte loops (row copies, VBMI lookups) take 64 bytes a step."""
    return _allows("avx512")


def has_vnni() -> bool:
    """AVX512-VNNI or AVX-VNNI: u8*s8 dot products accumulate in 32 bits (no 16-bit saturation). The C loops
    need AVX512-VNNI itself and check for it."""
    return _allows("vnni")


def cpu_sums_int8_exactly() -> bool:
    """Whether the CPU itself, whatever ``FXQUANT_ISA`` says, has a u8*s8 dot product that sums in 32 bits (VNNI,
    AVX-VNNI or AMX). Other engines pick their kernels by it: without it, ONNX Runtime's int8 GEMMs add pairs of
    products in 16 bits and saturate on activations that use all 8 bits (docs/export.md)."""
    flags = _cpu_flags()
    return any(needed <= flags for level in ("vnni", "amx") for needed in _LEVEL_FLAGS[level])


def has_amx_int8() -> bool:
    """AMX-INT8 tiles (the OS must also grant the tile state; the C loop asks and falls back when refused)."""
    return _allows("amx")


def isa_level() -> str:
    """The highest of :data:`ISA_LEVELS` that both this CPU and the cap allow."""
    return next((level for level in reversed(ISA_LEVELS) if _allows(level)), "below avx2")


def isa_summary() -> dict[str, bool]:
    return {"avx512f": has_avx512(), "avx512_vnni": has_vnni(), "amx_int8": has_amx_int8()}

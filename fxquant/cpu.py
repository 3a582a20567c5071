"""What this CPU can do, read once: which int8 instruction sets the kernels can use."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# Forcing the slow path lets tests exercise the non-VNNI behaviour on any machine.
_FORCE_NO_VNNI = "FXQUANT_ASSUME_NO_VNNI"


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


def has_vnni() -> bool:
    """AVX512-VNNI or AVX-VNNI: u8*s8 dot products accumulate in 32 bits (no 16-bit saturation)."""
    if os.environ.get(_FORCE_NO_VNNI):
        return False
    return bool({"avx512_vnni", "avx_vnni"} & _cpu_flags())


def has_amx_int8() -> bool:
    return "amx_int8" in _cpu_flags()


def isa_summary() -> dict[str, bool]:
    return {"avx512_vnni": has_vnni(), "amx_int8": has_amx_int8(), "avx512f": "avx512f" in _cpu_flags()}

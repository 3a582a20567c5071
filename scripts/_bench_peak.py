"""How close an INT8 model comes to the CPU's INT8 peak: multiply-accumulates per second over one core's peak.

MACs are counted with forward hooks on the float model's Conv/Linear layers at the timed input (the INT8 model runs
the same layers); the clock is measured by a chain of dependent register-to-register integer adds (one per cycle on
current x86 cores; not adds of an immediate, which Golden Cove's renamer folds several per cycle: read as 9.5 GHz on
a Sapphire Rapids VM whose clock is 2.4) in a tiny C program, best of many runs of a few ms, so that preemption on a
shared machine lowers it least (longer runs on a loaded machine read well below the clock), or read from
``/proc/cpuinfo`` when no C compiler is found.
Peak MACs per cycle per core:

- AMX (``TDPBUSD``): a 16x16x64 tile product, 16384 MACs, issued once per 16 cycles: 1024 MACs/cycle;
- AVX512-VNNI (``VPDPBUSD zmm``): 64 u8*s8 MACs per instruction, two per cycle on cores with two 512-bit
  multiply pipes (e.g. two-FMA Xeon Gold/Platinum): 128 MACs/cycle; half that on one-pipe parts.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from fxquant.native.isa import has_amx_int8

_CLOCK_C = r"""
#include <stdio.h>
#include <time.h>
int main(void) {
  const long n = 2500000L;  /* 10M cycles, ~3 ms: short enough that many runs see no preemption */
  double best = 0;
  for (int r = 0; r < 300; r++) {
    struct timespec a, b;
    unsigned long x = 0, one = 1;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++)
      __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0" : "+r"(x) : "r"(one));
    clock_gettime(CLOCK_MONOTONIC, &b);
    double ghz = 4.0 * n / ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec));
    if (ghz > best) best = ghz;
  }
  printf("%.4f\n", best);
  return 0;
}
"""


def count_macs(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Multiply-accumulates of every Conv and Linear of ``model`` on ``inputs`` (one forward, float)."""
    total = 0

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Linear):
            total += out.numel() * module.in_features
        else:
            assert isinstance(module, nn.modules.conv._ConvNd)
            total += out.numel() * module.in_channels // module.groups * math.prod(module.kernel_size)

    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)]
    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        with torch.inference_mode():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return total


def clock_ghz() -> tuple[float, str]:
    """The core clock in GHz and how it was obtained."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler:
        with tempfile.TemporaryDirectory() as tmp:
            source, binary = Path(tmp, "clock.c"), Path(tmp, "clock")
            source.write_text(_CLOCK_C)
            try:
                subprocess.run([compiler, "-O2", str(source), "-o", str(binary)], check=True, capture_output=True)
                out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
                return float(out), "measured: dependent-add loop, best of 300 runs of ~3 ms"
            except (subprocess.CalledProcessError, ValueError, OSError):
                pass
    return _cpuinfo_mhz() / 1e3, "/proc/cpuinfo 'cpu MHz' (may be the nominal clock, not the boost)"


def _cpuinfo_mhz() -> float:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return math.nan


def peak_line(what: str, macs: int, ms: float, who: str) -> str:
    """``what: X GMAC/s = Y% of <ISA> peak (Z GHz x N MAC/cycle)`` for one core running ``macs`` in ``ms``."""
    ghz, how = clock_ghz()
    isa, per_cycle = ("AMX", 1024) if has_amx_int8() else ("VNNI", 128)
    rate = macs / (ms / 1e3) / 1e9
    assumption = ("TDPBUSD: 16384 MACs per 16 cycles" if isa == "AMX" else
                  "VPDPBUSD zmm: 64 MACs, 2 per cycle (two 512-bit multiply pipes; 64 MAC/cycle on one-pipe cores)")
    return (f"{what}: {rate:.1f} GMAC/s = {100 * rate / (ghz * per_cycle):.1f}% of {isa} peak ({ghz:.2f} GHz x "
            f"{per_cycle} MAC/cycle) - {who}, {macs / 1e9:.2f} GMAC per call in {ms:.2f} ms, one core; "
            f"clock {how}; {assumption}")

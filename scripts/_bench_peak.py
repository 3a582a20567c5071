"""How close an INT8 model comes to the CPU's INT8 peak: multiply-accumulates per second over one core's peak.

MACs are counted with forward hooks on the float model's Conv/Linear layers at the timed input (the INT8 model runs
the same layers); the clock is measured by a chain of dependent register-to-register integer adds (one per cycle on
current x86 cores; not adds of an immediate, which Golden Cove's renamer folds several per cycle: read as 9.5 GHz on
a Sapphire Rapids VM whose clock is 2.4) in a tiny C program, best of many runs of a few ms, so that preemption on a
shared machine lowers it least (longer runs on a loaded machine read well below the clock), or read from
``/proc/cpuinfo`` when no C compiler is found.
Peak MACs per cycle per core:

- AMX (``TDPBUSD``): a 16x16x64 tile product, 16384 MACs, issued once per 16 cycles: 1024 MACs/cycle;
- AVX512-VNNI (``VPDPBUSD zmm``): 64 u8*s8 MACs per instruction. How many issue per cycle depends on the core: two
  on cores with two 512-bit multiply pipes (two-FMA Xeons, Zen 5), one on Zen 4, which splits a 512-bit op over its
  256-bit pipes. So it is measured, like the clock: twelve independent ``VPDPBUSD zmm`` chains in a tiny C program,
  best of many short runs, instructions per second times 64 is the peak. Without a C compiler two per cycle are
  assumed (the line says so);
- AVX2 alone (no AVX512, no VNNI): oneDNN's and fbgemm's int8 kernels take three instructions for 32 MACs
  (``VPMADDUBSW`` to 16-bit pair sums, ``VPMADDWD`` by ones to 32 bits, ``VPADDD``): measured the same way, six
  independent chains of those three on ymm registers. (AVX512 without VNNI runs the same step on zmm: not measured,
  the line says it assumed the VNNI rate.)
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from fxquant.native.isa import has_amx_int8, has_avx512, has_vnni, isa_level

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


# A throughput probe: CHAINS independent chains of BODY (asm on registers 0-11; SETUP fills 13-15), repeated; prints
# the best rate of chain steps per second (in G/s) over 300 short runs. Each probe fills in its DEFINES, SETUP, BODY.
_PROBE_C = r"""
#include <stdio.h>
#include <time.h>
@DEFINES@
int main(void) {
  const long n = 250000L;
  double best = 0;
  __asm__ volatile(@SETUP@ ::: "xmm13", "xmm14", "xmm15");
  for (int r = 0; r < 300; r++) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++)
      __asm__ volatile(@BODY@
                       ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                       "xmm11");
    clock_gettime(CLOCK_MONOTONIC, &b);
    double giga = @CHAINS@.0 * n / ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec));
    if (giga > best) best = giga;
  }
  printf("%.4f\n", best);
  return 0;
}
"""


def _probe(defines: str, setup: str, body: str, chains: int) -> str:
    return (_PROBE_C.replace("@DEFINES@", defines).replace("@SETUP@", setup).replace("@BODY@", body)
            .replace("@CHAINS@", str(chains)))


_VNNI_C = _probe(r'''#define DP(acc) "vpdpbusd %%zmm14, %%zmm15, %%zmm" #acc "\n\t"''',
                 r'''"vpternlogd $0xff, %%zmm14, %%zmm14, %%zmm14\n\tvpternlogd $0xff, %%zmm15, %%zmm15, %%zmm15"''',
                 "DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11)", 12)
# one u8*s8 step of an AVX2 int8 GEMM without VNNI: 32 products summed in pairs to 16 bits, pairs of those to 32 bits,
# added to the accumulator
_AVX2_C = _probe(r'''#define STEP(t, acc) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" #t "\n\tvpmaddwd %%ymm13, %%ymm" #t \
  ", %%ymm" #t "\n\tvpaddd %%ymm" #t ", %%ymm" #acc ", %%ymm" #acc "\n\t"''',
                 r'''"vpcmpeqd %%ymm13, %%ymm13, %%ymm13\n\tvpsrlw $15, %%ymm13, %%ymm13\n\t"
                   "vpcmpeqd %%ymm14, %%ymm14, %%ymm14\n\tvpcmpeqd %%ymm15, %%ymm15, %%ymm15"''',
                 "STEP(0, 6) STEP(1, 7) STEP(2, 8) STEP(3, 9) STEP(4, 10) STEP(5, 11)", 6)


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


def _run_c(program: str) -> float | None:
    """The number a tiny C program prints, or None without a C compiler (or if it fails)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp, "probe.c"), Path(tmp, "probe")
        source.write_text(program)
        try:
            subprocess.run([compiler, "-O2", str(source), "-o", str(binary)], check=True, capture_output=True)
            return float(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)
        except (subprocess.CalledProcessError, ValueError, OSError):
            return None


def clock_ghz() -> tuple[float, str]:
    """The core clock in GHz and how it was obtained."""
    measured = _run_c(_CLOCK_C)
    if measured is not None:
        return measured, "measured: dependent-add loop, best of 300 runs of ~3 ms"
    return _cpuinfo_mhz() / 1e3, "/proc/cpuinfo 'cpu MHz' (may be the nominal clock, not the boost)"


def vnni_per_second() -> float | None:
    """``VPDPBUSD zmm`` instructions per second on one core (twelve independent chains; best of 300 runs of ~1-3
    ms), or None where the CPU lacks AVX512-VNNI (or ``FXQUANT_ISA`` caps it) or there is no C compiler."""
    if not (has_vnni() and has_avx512()):  # AVX-VNNI alone has no zmm form
        return None
    giga = _run_c(_VNNI_C)
    return None if giga is None else giga * 1e9


def avx2_steps_per_second() -> float | None:
    """AVX2 int8 steps (``VPMADDUBSW`` + ``VPMADDWD`` + ``VPADDD`` on ymm: 32 MACs) per second on one core (six
    independent chains; best of 300 runs), or None without AVX2 (or ``FXQUANT_ISA`` below it) or a C compiler."""
    if isa_level() == "below avx2":
        return None
    giga = _run_c(_AVX2_C)
    return None if giga is None else giga * 1e9


def int8_peak(ghz: float) -> tuple[str, float, str]:
    """(ISA, one core's INT8 peak in GMAC/s, how it was obtained) at clock ``ghz``: AMX assumed; VNNI measured, else
    on AVX2 alone (oneDNN's and fbgemm's kernels there are the AVX2 step) that step measured; else assumed."""
    if has_amx_int8():
        return "AMX", ghz * 1024, "TDPBUSD: 16384 MACs per 16 cycles, assumed"
    vnni = vnni_per_second()
    if vnni is not None:
        return "VNNI", vnni * 64 / 1e9, (f"VPDPBUSD zmm: 64 MACs, measured {vnni / 1e9:.2f} G/s = "
                                         f"{vnni / 1e9 / ghz:.2f} per cycle (twelve independent chains, best of 300 "
                                         "runs)")
    avx2 = None if has_vnni() or has_avx512() else avx2_steps_per_second()  # AVX-VNNI, AVX512: assumed below
    if avx2 is not None:
        return "AVX2", avx2 * 32 / 1e9, (f"VPMADDUBSW+VPMADDWD+VPADDD ymm: 32 MACs, measured {avx2 / 1e9:.2f} G/s = "
                                         f"{avx2 / 1e9 / ghz:.2f} per cycle (six independent chains, best of 300 "
                                         "runs)")
    return "VNNI", ghz * 128, ("VPDPBUSD zmm: 64 MACs, 2 per cycle assumed (not measured: no C compiler, or "
                               "AVX512-VNNI absent or capped by FXQUANT_ISA)")


def _cpuinfo_mhz() -> float:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return math.nan


def peak_line(what: str, macs: int, ms: float, who: str) -> str:
    """``what: X GMAC/s = Y% of <ISA> peak (P GMAC/s; clock Z GHz) - ...`` for one core running ``macs`` in ``ms``,
    saying how the peak and the clock were obtained."""
    ghz, how = clock_ghz()
    rate = macs / (ms / 1e3) / 1e9
    isa, peak, assumption = int8_peak(ghz)
    # MACs are counted as the float model's direct convolutions have them; a Winograd conv multiplies fewer
    beyond = ("; above 100%: the count is the direct convolution's, and fxquant's Winograd 3x3 convs multiply 16 of "
              "every 36 of those MACs (docs/backends.md)" if rate > peak and isa == "AVX2" else "")
    return (f"{what}: {rate:.1f} GMAC/s = {100 * rate / peak:.1f}% of {isa} peak ({peak:.0f} GMAC/s; clock "
            f"{ghz:.2f} GHz) - {who}, {macs / 1e9:.2f} GMAC per call in {ms:.2f} ms, one core; clock {how}; "
            f"{assumption}{beyond}")

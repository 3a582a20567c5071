"""The INT8 peak that ``scripts/benchmark.py`` divides by: ``VPDPBUSD zmm`` issue rate measured, not assumed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from fxquant.native.isa import has_amx_int8, has_avx512, has_vnni

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _bench_peak import avx2_steps_per_second, clock_ghz, peak_line, vnni_per_second  # scripts/ is not a package


def test_the_vnni_probe_reads_one_or_two_instructions_per_cycle() -> None:
    """A core issues one (Zen 4: 512-bit ops over 256-bit pipes) or two (two 512-bit pipes) ``VPDPBUSD zmm`` per
    cycle; the probe's rate over the measured clock must be one of those, within the noise of a shared machine."""
    rate = vnni_per_second()
    if rate is None:
        pytest.skip("no AVX512-VNNI on this CPU (or FXQUANT_ISA caps it), or no C compiler: the peak is assumed")
    ghz, how = clock_ghz()
    if not how.startswith("measured"):
        pytest.skip(f"the clock is not measured here ({how})")
    per_cycle = rate / 1e9 / ghz
    assert min(abs(per_cycle - 1), abs(per_cycle - 2)) < 0.2, per_cycle
    if not has_amx_int8():  # with AMX the peak is the tiles'
        line = peak_line("row", macs=int(rate * 64), ms=1000.0, who="probe")  # the peak, for one second
        fraction = re.search(r"= ([0-9.]+)% of VNNI peak", line)  # the line measures the probe again
        assert fraction is not None and 90 < float(fraction.group(1)) < 110 and "measured" in line, line


def test_on_avx2_alone_the_peak_is_the_measured_avx2_step() -> None:
    """On AVX2 alone the engines' int8 kernels take VPMADDUBSW + VPMADDWD + VPADDD for 32 MACs: one such step per 4
    cycles (Zen 1: both multiplies split over one 128-bit multiply pipe) up to one per cycle (two 256-bit multiply
    pipes); the peak line divides by the measured rate."""
    if has_vnni() or has_avx512():
        pytest.skip("this CPU (under FXQUANT_ISA) has AVX512 or VNNI: the AVX2 step is not its peak")
    rate = avx2_steps_per_second()
    ghz, how = clock_ghz()
    if rate is None or not how.startswith("measured"):
        pytest.skip("no AVX2 or no C compiler here: nothing is measured")
    assert 0.15 < rate / 1e9 / ghz < 1.2, rate / 1e9 / ghz
    line = peak_line("row", macs=int(rate * 32), ms=1000.0, who="probe")  # the peak, for one second
    fraction = re.search(r"= ([0-9.]+)% of AVX2 peak", line)
    assert fraction is not None and 80 < float(fraction.group(1)) < 120 and "measured" in line, line

"""Where a report was measured: versions, CPU and its int8 instruction sets, threads, quantization recipe.

Latency and even accuracy depend on these (VNNI changes fbgemm's arithmetic, thread count changes speed-ups), so a
report that omits them cannot be compared with another one.
"""

from __future__ import annotations

import platform

import torch

from fxquant._version import __version__
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.native.isa import cpu_model, isa_summary
from fxquant.report.sections import Environment
from fxquant.state import QuantState


def describe_environment(state: QuantState, threads: int) -> Environment:
    """The environment of this process for a model quantized as ``state`` says, timed with ``threads`` threads."""

    return Environment(
        torch=torch.__version__, fxquant=__version__, python=platform.python_version(), cpu=cpu_model(),
        isa=isa_summary(), backend=state.backend or state.config.backend, threads=threads,
        observer=state.config.activation, weight=state.config.weight,
        calibration_samples=state.calibration_samples, onednn=onednn_direct.status(),
    )

"""``format="export"``: a ``torch.export`` ExportedProgram (``.pt2``) that needs only torch to load and run.

The program records the reference backend's arithmetic (:mod:`fxquant.kernels.reference`): uint8 activations, the
exact integer accumulator (``torch._int_mm``, float64 convolutions on the integers), the int32-rounded bias and one
requantization per layer, all aten ops, on the model's own qparams. It is the reference backend's output bit for bit
on those qparams, whichever backend the model was converted for: oneDNN's kernels agree with it within one output
step (docs/backends.md), and a TorchScript-free deployment gets the semantics fxquant defines, not one engine's.
Load it with::

    program = torch.export.load("model.pt2")
    (logits,) = program.module()(images)  # the outputs' tensors, as a tuple
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import fx

from fxquant.artifacts.export.lowered import relowered_copy, trace
from fxquant.kernels.reference import int_mm_is_exact
from fxquant.kernels.registry import get_backend


def write_program(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> tuple[bytes, torch.export.ExportedProgram]:
    """The ``.pt2`` bytes of converted ``gm`` and the program they hold."""
    int_mm_is_exact()  # probed once per process, outside the trace (which would record the probe)
    program = trace(relowered_copy(gm, get_backend("reference")), example_inputs)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue(), program

"""torchao PT2E static INT8 lowered by Inductor: the path PyTorch now recommends for x86 server CPUs.

``torch.export`` (batch dimension dynamic, so calibration and every timed batch share one graph) ->
``prepare_pt2e(X86InductorQuantizer with its default config)`` -> calibration -> ``convert_pt2e`` ->
``torch.compile`` with Inductor's ``freezing`` (needed for its oneDNN weight prepacking and int8 fusions).

Inductor specialises on input shapes (``dynamic=False``) and bakes the thread count of compile time into its C++
kernels, so the model is compiled once per thread count (a separate copy under each ``torch.set_num_threads``) and
per input shape, on the first call there — the benchmark's untimed warm-up — as a deployment compiled for its
thread count would be. ``cpp.dynamic_threads`` (one compile reading the count at run time) is off.

Non-strict export (the default) records two calls of one shared module (``self.relu`` used twice in a ResNet block)
as one source partition, on which ``X86InductorQuantizer`` raises "Input partition has more than one output node";
strict export (Dynamo) keeps the calls apart. Strict is tried when the default fails, as a user would.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from _bench_common import Candidate, Peer, Workload, register_peer


def _export(model: torch.nn.Module, example: tuple[torch.Tensor, ...], *, strict: bool) -> torch.fx.GraphModule:
    batch = torch.export.Dim("batch", min=1, max=1024)
    dynamic = tuple({0: batch} for _ in example)
    return torch.export.export(model, example, dynamic_shapes=dynamic, strict=strict).module()


def quantize_pt2e(workload: Workload) -> tuple[torch.fx.GraphModule, str]:
    """The converted (not yet compiled) PT2E model and how it was exported."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    example = workload.calibration[0]  # batch > 1, so export does not specialise the batch dimension to 1
    errors = []
    for strict in (False, True):
        quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
        try:
            prepared = prepare_pt2e(_export(copy.deepcopy(workload.model), example, strict=strict), quantizer)
        except Exception as exc:  # export or annotation failed: try the other export mode
            errors.append(f"{'strict' if strict else 'non-strict'} export: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            continue
        with torch.no_grad():
            for batch in workload.calibration:
                prepared(*batch)
        return convert_pt2e(prepared), "strict" if strict else "non-strict"
    raise RuntimeError("; ".join(errors))


class _Compiled:
    """Runs the converted model compiled for the current thread count; Inductor's options apply on each compile."""

    def __init__(self, converted: torch.fx.GraphModule) -> None:
        self.converted = converted
        self.compiled: dict[int, Any] = {}  # per thread count, each on its own copy so Dynamo's caches are apart
        self.seen: set[tuple[int, tuple[tuple[int, ...], ...]]] = set()

    def __call__(self, *inputs: torch.Tensor) -> Any:
        threads = torch.get_num_threads()
        key = (threads, tuple(tuple(x.shape) for x in inputs))
        if threads not in self.compiled:
            self.compiled[threads] = torch.compile(copy.deepcopy(self.converted), dynamic=False)
        if key in self.seen:
            return self.compiled[threads](*inputs)
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"freezing": True, "cpp.dynamic_threads": False}):
            out = self.compiled[threads](*inputs)
        self.seen.add(key)
        return out


@register_peer
class Pt2eInductor(Peer):
    """torchao ``prepare_pt2e``/``convert_pt2e`` with ``X86InductorQuantizer``, compiled by Inductor."""

    name = "pt2e"
    label = "PT2E+Inductor"
    requires = ("torchao.quantization.pt2e",)

    def build(self, workload: Workload) -> Candidate:
        converted, how = quantize_pt2e(workload)
        note = "strict export (the default non-strict one fails in X86InductorQuantizer)" if how == "strict" else ""
        return Candidate(self.label, _Compiled(converted), lazy=True, note=note)

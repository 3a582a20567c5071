"""torch.ao FX graph mode quantization, one peer per quantized engine this torch build has.

``prepare_fx`` with the engine's default qconfig mapping, calibration on the shared batches, ``convert_fx``. The
process-wide quantized engine is set while preparing, converting and on every call, and restored each time, so the
fxquant rows timed interleaved with these run under the process default, as a user's code would.

On the BERT-style encoder the default mapping observes the int64 ``position_ids`` buffer through ``torch.narrow``
(``HistogramObserver`` then raises ``"histogram_cpu" not implemented for 'Long'``), so ``torch.narrow`` is kept float
there, the one-line fix a user would make.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from _bench_common import Candidate, Peer, Workload, _quiet_torch_deprecations, count_torch_ao_qdq, register_peer

from fxquant.kernels.torch_engines.engine import quantized_engine

TORCH_AO_ENGINES = ("fbgemm", "x86", "qnnpack", "onednn")
FLOAT_OBJECTS = {"bert_style": (torch.narrow,)}  # per model: ops whose qconfig is set to None


class TorchAoFx(Peer):
    """``torch.ao.quantization.quantize_fx`` on ``engine``."""

    engine = ""
    requires = ("torch.ao.quantization.quantize_fx",)

    def unavailable_reason(self) -> str | None:
        if self.engine not in torch.backends.quantized.supported_engines:
            return f"engine {self.engine!r} not in this torch build"
        return super().unavailable_reason()

    def build(self, workload: Workload) -> Candidate:
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        engine, mapping = self.engine, get_default_qconfig_mapping(self.engine)
        for obj in FLOAT_OBJECTS.get(workload.name, ()):
            mapping = mapping.set_object_type(obj, None)
        with _quiet_torch_deprecations(), quantized_engine(engine), torch.no_grad():
            prepared = prepare_fx(copy.deepcopy(workload.model), mapping, workload.example)
            for batch in workload.calibration:
                prepared(*batch)
            qmodel = convert_fx(prepared)

        def run(*inputs: torch.Tensor) -> Any:
            with quantized_engine(engine):
                return qmodel(*inputs)

        floats = ", ".join(getattr(obj, "__name__", str(obj)) for obj in FLOAT_OBJECTS.get(workload.name, ()))
        note = f"qconfig None for torch.{floats}" if floats else ""
        return Candidate(self.label, run, count_torch_ao_qdq(qmodel), note=note)


for _engine in TORCH_AO_ENGINES:
    register_peer(type(f"TorchAoFx_{_engine}", (TorchAoFx,), {
        "name": f"torch.ao:{_engine}", "label": f"torch.ao FX[{_engine}]", "engine": _engine,
        "__doc__": f"torch.ao FX INT8 on the {_engine!r} engine."}))

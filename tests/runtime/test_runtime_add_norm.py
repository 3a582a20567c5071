"""A converted model's ``norm(a + b)`` pairs (:mod:`fxquant.runtime.add_norm`): one step on fxquant's loop where it
computes ``LayerNorm(a + b)``, torch's add and LayerNorm, bit for bit, for every other call; the graph walk makes
the step only for models with INT8 layers on a kernel backend.

Where the loop runs, the result is torch's to float32 rounding (the loop's own tests bound it against float64); a
spy records that it ran, so no case passes by comparing torch with itself.
"""

from __future__ import annotations

import pytest
import torch
from loop_spies import LoopSpy, spy_on
from torch import nn

import fxquant
from fxquant.models import example_inputs
from fxquant.native.layer_norm import add_layer_norm_into
from fxquant.qparams import sqnr_db
from fxquant.runtime import add_norm

TOLERANCE = 2e-5


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> LoopSpy:
    return spy_on(monkeypatch, add_norm, "add_layer_norm_into")


def _loop_runs_here() -> bool:
    x = torch.randn(2, 8)
    return add_layer_norm_into(torch.empty_like(x), x, x, None, None, 1e-5)


def _norm(width: int = 32) -> nn.LayerNorm:
    norm = nn.LayerNorm(width, eps=1e-12)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    return norm.requires_grad_(False)


CASES = {
    "same_shape": lambda: (torch.randn(2, 5, 32), torch.randn(2, 5, 32)),
    "broadcast_second": lambda: (torch.randn(2, 5, 32), torch.randn(1, 5, 32)),
    "broadcast_first": lambda: (torch.randn(5, 32), torch.randn(3, 5, 32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_loop_computes_the_norm_of_the_sum(case: str, spy: LoopSpy) -> None:
    if not _loop_runs_here():
        pytest.skip("the C loops are off here (FXQUANT_NATIVE=0, or built without a C compiler)")
    a, b = CASES[case]()
    norm = _norm()
    out = add_norm.fused(a, b, norm)
    assert spy.ran == 1 and out is not None
    assert (out - norm(a + b)).abs().max().item() < TOLERANCE


DECLINED = {
    "float64": lambda a, b, norm: (a.double(), b.double(), norm.double()),
    "strided": lambda a, b, norm: (a.transpose(0, 1).contiguous().transpose(0, 1), b, norm),
    "broadcast_inside": lambda a, b, norm: (a, b[:, :1].contiguous(), norm),
    "norm_over_two_dims": lambda a, b, norm: (a, b, nn.LayerNorm((5, 32))),
    "autograd": lambda a, b, norm: (a.requires_grad_(), b, norm),
    "norm_with_trainable_weight": lambda a, b, norm: (a, b, norm.requires_grad_(True)),
    "rms_norm": lambda a, b, norm: (a, b, nn.RMSNorm(32)),
}


@pytest.mark.parametrize("case", list(DECLINED))
def test_what_the_loop_does_not_compute_is_left_to_torch(case: str, spy: LoopSpy) -> None:
    a, b, norm = DECLINED[case](torch.randn(2, 5, 32), torch.randn(2, 5, 32), _norm())
    assert add_norm.fused(a, b, norm) is None
    assert spy.ran == 0


def _steps(qmodel: torch.fx.GraphModule) -> int:
    return sum(isinstance(step.target, add_norm.AddLayerNorm) for step in qmodel.forward.plan.steps)


@pytest.mark.parametrize("backend", ["onednn", "reference"])
def test_the_graph_walk_fuses_each_pair_only_on_kernel_backends(prepared_bert_style: torch.fx.GraphModule,
                                                                backend: str, spy: LoopSpy) -> None:
    """The converted encoder's 9 add + LayerNorm pairs (embeddings, then two per layer): one step each on onednn,
    the loop in each under inference mode; torch's ops on the reference backend, the generated code's output bit
    for bit."""
    qmodel = fxquant.convert(prepared_bert_style, backend=backend)
    x = example_inputs("bert_style", 2)
    with torch.inference_mode():
        out = qmodel(*x)
        generated = type(qmodel).forward(qmodel, *x)  # the generated code: torch's add and LayerNorm
    kernel = backend == "onednn"
    assert _steps(qmodel) == (9 if kernel else 0)
    assert spy.ran == (9 if kernel and _loop_runs_here() else 0)
    if spy.ran:  # each norm output is quantized next: a rounding difference can move a value by one step
        assert sqnr_db(generated, out) > 50.0  # measured: 55-136 dB at batch 2 (seeds, ISA caps)
    else:
        assert torch.equal(out, generated)


def test_hooks_on_the_norm_and_autograd_take_torchs_ops(prepared_bert_style: torch.fx.GraphModule,
                                                        spy: LoopSpy) -> None:
    """A hook on a LayerNorm sees its call (the generated code's output, bit for bit); with autograd on, the model's
    float LayerNorm weights require grad, so its output does too, as the generated code's."""
    qmodel = fxquant.convert(prepared_bert_style, backend="onednn")
    x = example_inputs("bert_style", 2)
    seen: list[torch.Tensor] = []
    handle = qmodel.get_submodule("layers.0.attention_norm").register_forward_hook(
        lambda module, args, result: seen.append(result))
    with torch.inference_mode():
        qmodel(*x)
    handle.remove()
    fused = 8 if _loop_runs_here() else 0
    assert len(seen) == 1 and spy.ran == fused  # the hooked pair alone took torch's ops
    out = qmodel(*x)  # autograd on: every pair declines
    assert spy.ran == fused and out.requires_grad

"""The residual add + LayerNorm loop (``fxquant/native/csrc/layer_norm.c``,
:func:`fxquant.native.layer_norm.add_layer_norm_into`) against ``LayerNorm(a + b)`` computed in float64.

Widths reach the loop's edges (below one 16-lane block, not a multiple of 16, BERT-base's 768), the three affine
cases (weight and bias, weight alone, none), a broadcast second addend (token + position embeddings) and values far
from zero mean (where a one-pass variance would lose digits). The loop sums in float32 lanes: errors are bounded,
not zero; torch's own kernel is held to the same bound, so the bound is float32's, not the loop's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_contract_cases import require_c_loops

from fxquant.native.layer_norm import add_layer_norm_into
from fxquant.native.loader import extension
from fxquant.report.latency import num_threads

TOLERANCE = 2e-5  # absolute, on outputs of unit scale (measured: at most 3e-6 for the loop and for torch)


def _reference(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    double = None if weight is None else weight.double()
    return F.layer_norm(a.double() + b.double(), (a.shape[-1],), double, None if bias is None else bias.double(), eps)


def _affine(width: int, kind: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    weight = torch.randn(width) if kind != "none" else None
    return weight, torch.randn(width) if kind == "weight_and_bias" else None


def _run(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
         eps: float) -> torch.Tensor:
    out = torch.full_like(a, float("nan"))
    assert add_layer_norm_into(out, a, b, weight, bias, eps)  # the loop ran: it writes and says so
    return out


@pytest.mark.parametrize("width", [1, 7, 16, 33, 256, 768])
@pytest.mark.parametrize("affine", ["weight_and_bias", "weight", "none"])
def test_the_loop_computes_layer_norm_of_the_sum(width: int, affine: str) -> None:
    require_c_loops()
    a, b = torch.randn(3, 5, width), torch.randn(3, 5, width)
    weight, bias = _affine(width, affine)
    expected = _reference(a, b, weight, bias, 1e-5)
    out = _run(a, b, weight, bias, 1e-5)
    assert (out.double() - expected).abs().max().item() < TOLERANCE
    torch_error = (F.layer_norm(a + b, (width,), weight, bias, 1e-5).double() - expected).abs().max().item()
    assert torch_error < TOLERANCE  # the bound is float32's: torch's kernel meets it too


def test_a_second_addend_broadcast_over_leading_dims_repeats_its_rows() -> None:
    """Token embeddings (batch, tokens, hidden) plus position embeddings (1, tokens, hidden)."""
    require_c_loops()
    a, b = torch.randn(4, 9, 64), torch.randn(1, 9, 64)
    weight, bias = _affine(64, "weight_and_bias")
    out = _run(a, b, weight, bias, 1e-12)
    assert (out.double() - _reference(a, b.expand_as(a), weight, bias, 1e-12)).abs().max().item() < TOLERANCE
    one = torch.randn(64)  # one row added to every row
    row = _run(a, one, weight, bias, 1e-12)
    assert (row.double() - _reference(a, one.expand_as(a), weight, bias, 1e-12)).abs().max().item() < TOLERANCE


def test_values_far_from_zero_mean_keep_their_digits() -> None:
    """Post-LN residual streams drift: rows of mean 1000 and spread 1. A variance taken as E[x^2] - E[x]^2 in float32
    would lose all of it; two passes over the row keep it."""
    require_c_loops()
    a, b = torch.randn(64, 256) + 1000.0, torch.randn(64, 256)
    out = _run(a, b, None, None, 1e-12)
    assert (out.double() - _reference(a, b, None, None, 1e-12)).abs().max().item() < 1e-3  # float32 inputs near 1e3


def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    """Rows are split over torch's threads, each row one thread's arithmetic."""
    require_c_loops()
    a, b = torch.randn(512, 384), torch.randn(512, 384)  # enough values to wake the team
    weight, bias = _affine(384, "weight_and_bias")
    outs = []
    for threads in (1, 2):
        with num_threads(threads):
            outs.append(_run(a, b, weight, bias, 1e-12))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("bad", ["no_rows_of_b", "rows_not_a_multiple", "width_zero", "bias_without_weight",
                                 "negative_eps"])
def test_the_entry_point_refuses_what_the_loop_does_not_compute(bad: str) -> None:
    require_c_loops()
    x = torch.randn(4, 8)
    shape, affine, eps = {
        "no_rows_of_b": ((4, 0, 8), (0, 0), 1e-5),
        "rows_not_a_multiple": ((4, 3, 8), (0, 0), 1e-5),
        "width_zero": ((4, 4, 0), (0, 0), 1e-5),
        "bias_without_weight": ((4, 4, 8), (0, x.data_ptr()), 1e-5),
        "negative_eps": ((4, 4, 8), (0, 0), -1.0),
    }[bad]
    with pytest.raises(ValueError, match="add_layer_norm_f32"):
        extension.add_layer_norm_f32((x.data_ptr(), x.data_ptr(), x.data_ptr()), shape, affine, eps)

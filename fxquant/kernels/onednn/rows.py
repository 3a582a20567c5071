"""The onednn backend's few-row Linears on fxquant's AVX2 row loop, on CPUs with AVX2 alone.

Without VNNI, oneDNN's int8 matmul sums pairs of u8*s8 products in 16 bits (``vpmaddubsw``) on 7-bit activations,
and at one to a few rows it reads each weight byte through a GEMM built for many: on an AMD EPYC Zen 1 it takes
1.05-2.1x the time of fxquant's row loop on 1 to 32 rows (``fxquant/native/csrc/rows_avx2.c``), which streams the
weights once in the order it sums them (docs/backends.md, "Few-row Linears on CPUs with AVX2 alone"). The loop sums
the same pairs exactly, as oneDNN does on 7-bit inputs, and requantizes as oneDNN's primitive does
(``OnednnRequant``: the sum times ``s_x * s_w`` in float32, plus the float bias, then the ReLU, then times
``1 / s_out`` plus the zero point, rounded to nearest even): the same bytes, or float32 values, as the primitive
(tests/kernels/test_onednn_rows.py).

The loop takes a call where AVX2 is the highest instruction set fxquant may use (a CPU with AVX2 alone, or
``FXQUANT_ISA=avx2``), the input is 7-bit (the range the backend gives activations without VNNI), the output
uint8 or float32 with no post-op but a ReLU, at most :data:`MAX_ROWS` rows, and torch's thread count within
the loop's limit (``native.THREAD_LIMITS["onednn_linear"]``); other calls keep the primitive. A call is a
:data:`~fxquant.kernels.recording.AddressCall`, so a replayed run (:mod:`fxquant.runtime.replay`) holds it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from fxquant import native
from fxquant.kernels import recording
from fxquant.kernels.onednn.direct import Output, uint8_input
from fxquant.native.amx_gemm import OnednnRequant, OnednnRows, padded, rows_layout
from fxquant.native.isa import has_avx2, has_avx512, has_vnni
from fxquant.qparams import QParams

if TYPE_CHECKING:
    from fxquant.kernels.onednn.weights import Call, OnednnWeight

MAX_ROWS = 32  # above, at one thread the loop gains under 5% (measured to 64 rows: docs/backends.md)
FAMILY = "onednn_linear"  # its thread limit in native.THREAD_LIMITS
_SEVEN_BIT = 127  # the loop's 16-bit pair sums are exact on inputs up to this


def usable(in_qp: QParams | None) -> bool:
    """Whether the loop can run this process's calls on inputs ``in_qp`` (thread count aside): C loops on, 7-bit
    inputs, and AVX2 as the highest instruction set fxquant may use, where it was measured against oneDNN's AVX2
    kernel (with VNNI the backend's activations are 8-bit and oneDNN's VNNI kernel runs them; on AVX512 without VNNI
    oneDNN's kernel is another, not measured against the loop)."""
    return (in_qp is not None and not in_qp.per_channel and in_qp.qmin >= 0 and in_qp.qmax <= _SEVEN_BIT
            and native.loader.loops is not None and has_avx2() and not has_avx512() and not has_vnni())


def takes_one_row(in_qp: QParams | None) -> bool:
    """Whether the loop would run a one-row call on inputs ``in_qp`` at torch's current thread count."""
    return usable(in_qp) and native.available(FAMILY)


def loop_qmax(output: Output, post_op: str, within: QParams | None, dtypes: tuple[torch.dtype, ...]) -> int | None:
    """The top of the output's range where a C loop with oneDNN's requantization gives the primitive's result: an
    output of one of ``dtypes``, no post-op but a ReLU, and a range from 0 (the loop saturates at its top, as the
    primitive's clip post-op bounds it); else None."""
    qmin, qmax = (0, 255) if within is None else (within.qmin, within.qmax)
    return qmax if output[2] in dtypes and post_op in ("none", "relu") and qmin == 0 else None


def onednn_requant(w: OnednnWeight, operands: tuple[float, int, torch.Tensor | None], output: Output, post_op: str,
                   qmax: int) -> tuple[OnednnRequant, torch.Tensor, torch.Tensor]:
    """oneDNN's requantization of ``w``'s sums as fxquant's primitives configure it, for the C loops that compute
    their bytes (this row loop and :mod:`~fxquant.kernels.onednn.winograd`):
    the ``OnednnRequant`` (zero points, ReLU, float or uint8 output saturating at ``qmax``, ``1 / s_out`` in
    float32), the float32 multipliers ``s_x * s_w`` per output channel and the float32 bias (zeros for none).
    ``operands``: the input scale and zero point the call uses and the bias that goes with them
    (``weights.operands``)."""
    x_scale, x_zp, bias = operands
    scale, zero_point, dtype = output
    multipliers = torch.tensor(x_scale, dtype=torch.float32) * w.scale.float().reshape(-1).expand(w.out_channels)
    dst_inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))
    requant = OnednnRequant(x_zp, zero_point, post_op == "relu", dtype is torch.float32, qmax, dst_inv)
    return requant, multipliers, torch.zeros(w.out_channels) if bias is None else bias.float()


def row_call(w: OnednnWeight, shape: tuple[int, ...], in_qp: QParams, output: Output, post_op: str,
             within: QParams | None, operands: tuple[float, int, torch.Tensor | None]) -> Call | None:
    """The Linear on inputs of ``shape`` by the row loop, or None where the primitive should run it (see the module
    docstring); ``output``, ``post_op`` and ``within`` as for ``calls.bind_linear``; ``operands``: the input scale
    and zero point the call uses and the bias that goes with them (``weights.operands``)."""
    rows = math.prod(shape[:-1])
    qmax = loop_qmax(output, post_op, within, (torch.uint8, torch.float32))
    if rows > MAX_ROWS or qmax is None or not usable(in_qp) or not native.available(FAMILY):
        return None
    layout = w.row_layout
    if layout is None:  # one copy in the loop's layout per weight, whichever calls share it
        layout = rows_layout(w.unpacked())
        object.__setattr__(w, "row_layout", layout)
    n_pad = layout.shape[0] * 64
    column_sums = layout.sum((1, 3), dtype=torch.int32).reshape(n_pad)  # (the padding's zeros sum to 0)
    requant, multipliers, bias = onednn_requant(w, operands, output, post_op, qmax)
    factors = (torch.zeros(n_pad, dtype=torch.int32), padded(bias, n_pad), padded(multipliers, n_pad))
    float_out, dtype = requant.float_out, output[2]
    run = OnednnRows(rows, (shape[-1], w.out_channels * (4 if float_out else 1)), layout, column_sums, factors,
                     (shape[-1], w.out_channels), requant)
    out_shape, empty = (*shape[:-1], w.out_channels), torch.empty

    def call(a: torch.Tensor) -> torch.Tensor:
        a = uint8_input(a, torch.contiguous_format)
        out = empty(out_shape, dtype=dtype)
        run(a.data_ptr(), out.data_ptr())
        recording.record(run, a.data_ptr(), out)
        return out

    call.loop = run  # type: ignore[attr-defined]  # (as onednn_direct's calls carry their primitive)
    return call


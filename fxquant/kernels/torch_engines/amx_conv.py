"""fbgemm's and qnnpack's convs and Linears in fxquant's C loops: ``conv_u8`` on AMX tiles and the VNNI (or, for
fbgemm, AVX2) row loop for few-row Linears (in :mod:`fxquant.native`), bit-identical to the engine's own kernel.

fbgemm builds an im2col copy of the input on every call, which dominates on convs with few channels, and qnnpack's
x86 kernels are SSE2 (docs/amx.md, "Why: fbgemm's im2col on few-channel convs"). With AMX-INT8 the C loop sums the
same u8*s8 products exactly in int32 tiles straight from a zero-point-padded copy of the input, then requantizes as
the engine does, per output channel - fbgemm: ``(float(acc - z_x * sum(w)) + bias / (s_x * s_w)) * (s_x * s_w /
s_out)``; qnnpack: ``float(acc - z_x * sum(w) + round(bias / (s_x * s_w))) * (s_w * s_x * (1 / s_out))`` - rounded
to nearest even. Because the bytes are the engine's, a traced TorchScript export (which records the engine's ops: the
loop is skipped while tracing) computes what the eager model computes.

Taken for Linears (as 1x1 convs over their rows) and 1-, 2- and 3-d convs with groups 1, dilation 1 and
per-channel weights with zero point 0 (fxquant's default), at sizes where it was measured faster
(:meth:`NativeConv.takes`); everything else keeps the engine's kernels: convs without AMX, qnnpack's Linears
without VNNI (qnnpack sums 8-bit inputs exactly, the AVX2 loop in 16-bit pairs as fbgemm does). This module owns that
dispatch: it lays out weights and requantization constants at packing (:func:`native_conv`) and decides, per call,
whether a loop runs (:func:`run_conv`, :func:`run_linear`); the quantized tensors themselves are made in
:mod:`fxquant.kernels.torch_engines.engine`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fxquant import native
from fxquant.kernels.base import ConvSpec
from fxquant.kernels.torch_engines.engine import empty_quantized, grid, int32_bias, is_quint8
from fxquant.native.amx_gemm import rows_layout
from fxquant.native.isa import has_amx_int8, has_avx2, has_avx512_vnni, has_vnni
from fxquant.qparams import QParams

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # int32 bias, float bias, float multiplier per channel


@dataclass(frozen=True)
class NativeConv:
    """A conv's weight for the C loop: ``weight`` (kd * kh * ceil(kw * C_in / 4), n_pad, 4) int8 - four consecutive
    (kernel column, channel) inputs of one output channel together, zeros beyond each kernel row and beyond C_out;
    per-output-channel weight sums (the input zero point's share), float bias and weight scales, zero-padded to
    ``n_pad`` (a multiple of 16); ``engine``: whose requantization the bytes follow."""

    weight: torch.Tensor
    column_sums: torch.Tensor
    bias: torch.Tensor
    weight_scales: torch.Tensor
    in_channels: int
    out_channels: int
    spec: ConvSpec
    kernel: tuple[int, int, int]  # depth, height, width (1 for the dimensions a 1-d or 2-d conv lacks)
    engine: str = "fbgemm"
    linear: bool = False  # a Linear run as a 1x1 conv over its rows
    row_weight: torch.Tensor | None = None  # a Linear's weight blocked by 64 channels for the VNNI row loop
    tiles: bool = True  # the CPU (within FXQUANT_ISA) has AMX-INT8; else only a Linear's row loop runs
    vnni: bool = True  # the row loop sums with VNNI; else with AVX2 alone (fbgemm's Linears only)
    _factors: dict[tuple[float, float], Factors] = field(default_factory=dict, repr=False)

    def macs(self, positions: int) -> int:
        return positions * self.out_channels * self.in_channels * self.kernel[0] * self.kernel[1] * self.kernel[2]

    def takes(self, positions: int) -> bool:
        """Whether a C loop beats the engine's own kernel for ``positions`` outputs per channel (measured per layer,
        ``scripts/bench_amx_layers.py``, tables in ``docs/amx.md``). Convs need AMX tiles; qnnpack's convs keep
        their kernel below 2**17 multiply-adds, where the loop's fixed cost per call dominates. A Linear takes the
        tiles from 16 rows and 2**20 multiply-adds and the VNNI row loop below that, where 16-row tiles would be
        mostly empty. On a CPU with VNNI but no AMX the row loop runs below 16 rows (fbgemm's: below 8 rows or
        2**22 multiply-adds) and the engine's kernel above; with AVX2 alone, fbgemm's Linears within the same
        limits."""
        if self.linear:
            few = positions < 8 or self.macs(positions) < 1 << 22  # fbgemm's VNNI kernel wins above (docs/amx.md)
            return self.tiles or (positions < 16 and (self.engine == "qnnpack" or few))
        return self.tiles and (self.engine != "qnnpack" or self.macs(positions) >= 1 << 17)

    @property
    def family(self) -> str:
        """Its loop family in the thread rule (``native.THREAD_LIMITS``): the AVX2 row loop splits its channels over
        torch's threads, the others run on one."""
        if not self.linear:
            return "conv"
        return f"{self.engine}_linear" if self.vnni else "avx2_linear"

    def tiled(self, positions: int) -> bool:
        """Whether :meth:`takes` means the AMX tiles (else, for a Linear, the row loop)."""
        return self.tiles and (not self.linear or (positions >= 16 and self.macs(positions) >= 1 << 20))

    def factors(self, in_scale: float, out_scale: float) -> Factors:
        """The engine's per-channel requantization constants, rounded as it rounds them (cached per pair of scales:
        they are fixed once a model is converted). fbgemm adds ``bias / (s_x * s_w)`` in float and multiplies by
        ``(s_x * s_w) / s_out``; qnnpack adds the bias rounded to int32 steps of ``s_x * s_w`` (torch's
        ``quantize_per_channel``, as its ``QuantizeBias``) and multiplies by ``(s_w * s_x) * (1 / s_out)``."""
        key = (in_scale, out_scale)
        if key not in self._factors:
            x_scale, o_scale = torch.tensor(in_scale, dtype=torch.float32), torch.tensor(out_scale, dtype=torch.float32)
            zeros = torch.zeros_like(self.bias)
            if self.engine == "qnnpack":
                steps = self.weight_scales.double() * in_scale
                rounded = int32_bias(self.bias, steps)
                multipliers = self.weight_scales * x_scale * (torch.tensor(1.0, dtype=torch.float32) / o_scale)
                self._factors[key] = (rounded, zeros, multipliers)
            else:
                product = x_scale * self.weight_scales
                self._factors[key] = (torch.zeros_like(self.column_sums), self.bias / product, product / o_scale)
        return self._factors[key]


def native_conv(weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, spec: ConvSpec, *,
                engine: str = "fbgemm", linear: bool = False) -> NativeConv | None:
    """Lay out an int8 conv ``weight`` (C_out, C_in, *kernel) for the C loop, or None where the loop does not take
    it (grouped, dilated or transposed, weights per tensor or with zero points, no C extension, a conv without AMX,
    a Linear without AVX512-VNNI or, for fbgemm on a CPU without VNNI, AVX2)."""
    tiles, vnni = has_amx_int8(), has_avx512_vnni()
    # the AVX2 loop only where activations are 7-bit: exact there, as every fbgemm kernel is
    row_loop = linear and (vnni or (engine == "fbgemm" and not has_vnni() and has_avx2()))
    if (native.loops is None or not (tiles or row_loop) or spec.groups != 1 or spec.transposed
            or any(d != 1 for d in spec.dilation) or w_qp.axis != 0 or bool(w_qp.zero_point.ne(0).any())):
        return None
    out_channels, in_channels = weight.shape[:2]
    kernel = (1,) * (5 - weight.dim()) + tuple(weight.shape[2:])
    span = kernel[2] * in_channels  # one kernel row's inputs, (kernel column, channel), rounded up to groups of 4
    span_pad, n_pad = -(-span // 4) * 4, -(-out_channels // 16) * 16
    padded = weight.new_zeros(n_pad, kernel[0] * kernel[1], span_pad)
    rows = weight.reshape(out_channels, in_channels, *kernel).permute(0, 2, 3, 4, 1)
    padded[:out_channels, :, :span] = rows.reshape(out_channels, kernel[0] * kernel[1], span)
    sums = torch.zeros(n_pad, dtype=torch.int32)
    sums[:out_channels] = weight.reshape(out_channels, -1).sum(1, dtype=torch.int32)
    floats = torch.zeros(2, n_pad)
    if bias is not None:
        floats[0, :out_channels] = bias.detach().float()
    floats[1, :out_channels] = w_qp.scale.float()
    floats[1, out_channels:] = 1.0  # padding channels: any finite scale
    packed = padded.reshape(n_pad, kernel[0] * kernel[1] * span_pad // 4, 4).transpose(0, 1).contiguous()
    row_weight = rows_layout(weight.reshape(out_channels, in_channels)) if linear else None
    return NativeConv(packed, sums, floats[0].clone(), floats[1].clone(), in_channels, out_channels, spec,
                      (kernel[0], kernel[1], kernel[2]), engine, linear, row_weight, tiles, vnni)


def run_conv(a: torch.Tensor, loop: NativeConv | None, scale: float, zp: int, relu: bool,
             qmax: int) -> torch.Tensor | None:
    """The conv by the C loop on AMX tiles (the engine's results, channels-last, saturated to ``qmax`` as the
    engine's op and a clamp to a 7-bit output range give them), or None: no loop for this layer, a traced export (it
    records the engine's conv), a size where the engine's kernel is faster, or a process without AMX. An input with
    strided channels (fbgemm's 3-d convs return NCDHW) is made channels-last first, as the engine itself does."""
    if loop is None:
        return None
    spec = loop.spec
    if not native.available(loop.family) or torch.jit.is_tracing() or not is_quint8(a) or a.dim() != spec.dim + 2 \
            or a.shape[1] != loop.in_channels:
        return None
    kernel = loop.kernel[3 - spec.dim:]
    size = [(a.shape[2 + i] + 2 * spec.padding[i] - kernel[i]) // spec.stride[i] + 1 for i in range(spec.dim)]
    positions = a.shape[0] * math.prod(size)
    if min(size) < 1 or not loop.takes(positions):
        return None
    if a.stride(1) != 1 and a.shape[1] > 1:
        a = a.movedim(1, -1).contiguous().movedim(-1, 1)
    shape = [a.shape[0], *size, loop.out_channels]  # allocated channels-last, as fbgemm returns its 2-d outputs
    out = empty_quantized(shape, scale, zp).movedim(-1, 1)
    in_scale, in_zp = grid(a)
    done = native.conv_into(out, a, loop.weight, loop.column_sums, loop.factors(in_scale, scale),
                            loop.out_channels, (kernel, spec.stride, spec.padding),
                            native.Requant(in_zp, zp, relu, qmax))
    return out if done else None


def run_linear(a: torch.Tensor, loop: NativeConv | None, scale: float, zp: int, relu: bool,
               qmax: int) -> torch.Tensor | None:
    """A Linear on the rows of a contiguous ``a`` by a C loop (the engine's results, saturated to ``qmax``), or
    None: no loop for this layer, an input the loop does not read (fewer than two dims, not ``in_channels`` wide, not
    contiguous), no C loops in this process, a traced export, or a size where the engine's kernel is faster
    (:meth:`NativeConv.takes`)."""
    # the size rule first: it is what declines most calls (fbgemm's kernel above a few rows), in plain integers; an
    # input of the wrong width goes to the engine's op, which says so
    if loop is None or a.dim() < 2 or a.shape[-1] != loop.in_channels or not loop.takes(a.numel() // a.shape[-1]) \
            or not a.is_contiguous() or not native.available(loop.family) or torch.jit.is_tracing():
        return None
    flat = a.dim() == 2  # no reshapes then: each costs microseconds per call, on a call of a few tens
    rows = a if flat else a.reshape(-1, a.shape[-1])
    if loop.tiled(rows.shape[0]):  # AMX tiles: the rows as the positions of a 1-d conv
        tiles = run_conv(rows.t().unsqueeze(0), loop, scale, zp, relu, qmax)
        return None if tiles is None else tiles[0].t().reshape(*a.shape[:-1], loop.out_channels)
    out = _run_rows(rows, loop, scale, zp, relu, qmax)
    return out if out is None or flat else out.reshape(*a.shape[:-1], loop.out_channels)


def _run_rows(rows: torch.Tensor, loop: NativeConv, scale: float, zp: int, relu: bool,
              qmax: int) -> torch.Tensor | None:
    """A Linear on a few ``rows`` by the row loop (the engine's results), or None on a CPU without AVX2."""
    if not is_quint8(rows) or loop.row_weight is None:
        return None
    out = empty_quantized([rows.shape[0], loop.out_channels], scale, zp)
    in_scale, in_zp = grid(rows)
    done = native.linear_rows_into(out, rows, loop.row_weight, loop.column_sums, loop.factors(in_scale, scale),
                                   loop.out_channels, native.Requant(in_zp, zp, relu, qmax))
    return out if done else None

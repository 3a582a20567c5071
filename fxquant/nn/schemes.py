"""The INT8 Linears of the float-in, float-out schemes (``QuantConfig(scheme=...)``, docs/quantization.md).

- :class:`DynamicInt8Linear` (``"dynamic"``, W8A8-dynamic): each input row quantized at run time, per-channel int8
  weights, exact int32 sums (:mod:`fxquant.kernels.per_token`);
- :class:`DynamicGroupInt8Linear` (``"dynamic_group"``, W8A8-dynamic with one activation scale per 128 inputs
  of each row, :mod:`fxquant.kernels.per_group`): a row's outlier channels cost only their group;
- :class:`StaticOutliersInt8Linear` (``"static_outliers"``, W8A8 static): the input range calibrated over the
  ordinary tokens, a token outside it quantized with its own scale (:mod:`fxquant.kernels.static_outliers`);
- :class:`WeightOnlyInt8Linear` (``"weight_only"``, W8A16): int8 weights, float activations
  (:mod:`fxquant.kernels.weight_only`).

Each keeps only the int8 weight (``qweight``), its float32 scales (per output channel; weight-only: per 64 inputs of
each output) and the float32 bias (no float copy of the weight), and reads and returns float; all but
``static_outliers`` need no calibration. They stand where a float ``nn.Linear`` stood, anywhere in a graph, and
in code torch.fx cannot trace in place of the Linear itself (no island around them: a decode step calls a few
hundred of them). What user code reads from a Linear reads the same here: ``in_features``/``out_features``,
``bias``, and ``weight``, the float weight they compute with, made on access.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxquant.kernels.per_group import group_size, pack_weights, packed_rows, per_group_linear, unpack_weights
from fxquant.kernels.per_token import per_token_linear
from fxquant.kernels.static_outliers import static_bias, static_outliers_linear
from fxquant.kernels.weight_only import GROUP, weight_only_linear
from fxquant.observers import Observer, get_weight_observer
from fxquant.qparams import QParams, quantize


class SchemeLinear(nn.Module):
    """int8 ``qweight`` (out_features, in_features) with float32 ``weight_scale`` (per output channel, or (out_features,
    groups)) and ``bias``; ``scheme`` names the scheme, ``kernel`` what computes it (for coverage).

    ``forward`` reads its buffers with :meth:`buffer`, from ``self._buffers``, without ``nn.Module.__getattr__``'s
    lookup: a decode step calls a few hundred of these Linears, each reading five buffers, so per-call Python is a
    visible share of the step."""

    scheme: str
    kernel: str
    qweight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None  # SmoothQuant's 1/s per input channel, taken over from a ChannelScale in front

    def __init__(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", quantize(weight.detach(), w_qp).contiguous())
        self.register_buffer("weight_scale", w_qp.scale.float().expand(self.out_features).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("input_scale", None)
        self.meta: dict[str, Any] = {}  # what passes record about the layer, as a GraphModule's meta (SmoothQuant's)

    @classmethod
    def from_float(cls, linear: nn.Linear, weight: str) -> SchemeLinear:
        """The INT8 layer of ``linear`` with weights quantized by ``weight`` (``QuantConfig.weight``)."""
        return cls(linear.weight, get_weight_observer(weight)().qparams(linear.weight.detach()), linear.bias)

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight (out_features, in_features), whatever layout the kernel keeps it in."""
        return self.qweight

    def buffer(self, name: str) -> Any:
        """The buffer ``name`` (a tensor, or None where unset), without ``nn.Module.__getattr__``'s lookup."""
        return self._buffers[name]

    def int8_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """The int8 weights of the outputs ``outputs`` (1-d indices): (len(outputs), in_features)."""
        return self.qweight[outputs]

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight the layer applies to its (unscaled) input."""
        return self._dequantized(self.int8_weight(), self.weight_scale)

    def weight_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        """The rows of :meth:`dequantized_weight` of the outputs ``outputs`` (indices of any shape):
        (*outputs.shape, in_features) float32, made from those rows alone. A tied input embedding reads its
        vectors so (:class:`~fxquant.nn.tied_embedding.TiedInt8Embedding`). An index outside ``[0, out_features)``
        raises ``IndexError`` as ``nn.Embedding`` does (``index_select`` checks, within the op: no host sync, and
        ``torch.export`` records it)."""
        flat = outputs.reshape(-1)
        scales = self.weight_scale.index_select(0, flat)  # first: it rejects what int8_rows would not (padding rows)
        rows = self._dequantized(self.int8_rows(flat), scales)
        return rows.view(*outputs.shape, self.in_features)

    def _dequantized(self, qweight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        """int8 rows times their scales (one per row, or per group of inputs of each row), times ``input_scale``."""
        groups = self.weight_scale.numel() // self.out_features
        scale = weight_scale.view(qweight.shape[0], groups, 1)
        grouped = qweight.view(qweight.shape[0], groups, self.in_features // groups)
        weight = (grouped.float() * scale).view(qweight.shape)
        return weight if self.input_scale is None else weight * self.input_scale

    @property
    def weight(self) -> torch.Tensor:
        """The float weight this layer computes with, as the Linear it replaced held it (made on each access; none is
        kept)."""
        return self.dequantized_weight()

    def derive_buffers(self) -> None:
        """Make the buffers the kernel reads beside ``qweight`` and derives from it (none here): they are not part of
        the state dict, so loading one makes them again."""

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.derive_buffers()  # a loaded qweight must not meet sums of the weights it replaced

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class DynamicInt8Linear(SchemeLinear):
    """W8A8 with per-token activation scales computed at run time (``QuantConfig(scheme="dynamic")``)."""

    scheme = "dynamic"
    kernel = "torch._int_mm, VNNI rows"
    weight_sums: torch.Tensor

    def __init__(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None) -> None:
        super().__init__(weight, w_qp, bias)
        self.derive_buffers()

    def derive_buffers(self) -> None:
        # the int32 sums of each output's weights, for the few-row VNNI loop (kernels.per_token)
        self.register_buffer("weight_sums", self.qweight.sum(dim=1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.buffer
        return per_token_linear(x, b("qweight"), b("weight_scale"), b("bias"), weight_sums=b("weight_sums"),
                                input_scale=b("input_scale"))


class DynamicGroupInt8Linear(SchemeLinear):
    """W8A8 with one activation scale per group of inputs of each row, computed at run time
    (``QuantConfig(scheme="dynamic_group")``); per-output int8 weights. ``qweight`` holds them in the layout the
    kernel reads (:func:`~fxquant.kernels.per_group.pack_weights`, no second copy); :meth:`int8_weight` unpacks.
    ``group`` inputs share a scale (:func:`~fxquant.kernels.per_group.group_size`)."""

    scheme = "dynamic_group"
    kernel = "VNNI per-group loop (without VNNI: float32 GEMMs per group)"
    group_sums: torch.Tensor

    def __init__(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None) -> None:
        super().__init__(weight, w_qp, bias)
        group = group_size(self.in_features)
        if group is None:
            raise ValueError(f"DynamicGroupInt8Linear: {self.in_features} input features are not a multiple of 4")
        self.group = group
        self.qweight, group_sums = pack_weights(self.qweight, group)
        self.register_buffer("group_sums", group_sums, persistent=False)

    def derive_buffers(self) -> None:
        # 128 times each group's weight sum of each output, for the VNNI loop (kernels.per_group); made with the
        # packing in __init__, again here for a loaded qweight
        self.register_buffer("group_sums", pack_weights(self.int8_weight(), self.group)[1], persistent=False)

    @classmethod
    def from_float(cls, linear: nn.Linear, weight: str) -> SchemeLinear:
        """The per-group layer of ``linear``; a Linear whose inputs are not a multiple of 4 (no group fits the
        kernel) runs per-token (:class:`DynamicInt8Linear`) instead, and says so as its ``scheme``."""
        if group_size(linear.in_features) is None:
            return DynamicInt8Linear.from_float(linear, weight)
        return super().from_float(linear, weight)

    def int8_weight(self) -> torch.Tensor:
        return unpack_weights(self.qweight, self.out_features)

    def int8_rows(self, outputs: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.qweight, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.buffer
        return per_group_linear(x, b("qweight"), b("group_sums"), b("weight_scale"), b("bias"),
                                out_features=self.out_features, group=self.group, input_scale=b("input_scale"))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


class StaticOutliersInt8Linear(DynamicInt8Linear):
    """W8A8 with the input range calibrated over the ordinary tokens; a token (row) outside it takes its own scale
    (``QuantConfig(scheme="static_outliers")``, :mod:`fxquant.kernels.static_outliers`). ``input_qparams`` is
    the calibrated uint8 ``(scale, zero_point)``; the int8 weights and their sums are the per-token layer's."""

    scheme = "static_outliers"
    kernel = "torch._int_mm, static range, own scale for outlier tokens"
    input_qparams: torch.Tensor
    fitted_bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, w_qp: QParams, bias: torch.Tensor | None, input_qp: QParams) -> None:
        super().__init__(weight, w_qp, bias)
        self.register_buffer("input_qparams", torch.tensor([float(input_qp.scale), int(input_qp.zero_point)],
                                                           dtype=torch.float64))
        self.derive_buffers()

    @classmethod
    def from_float(cls, linear: nn.Linear, weight: str) -> SchemeLinear:
        raise TypeError("StaticOutliersInt8Linear needs a calibrated input range: use from_observed(linear, weight, "
                        "observer), as convert does")

    @classmethod
    def from_observed(cls, linear: nn.Linear, weight: str, observer: Observer) -> StaticOutliersInt8Linear:
        """The INT8 layer of ``linear`` with its input range from calibrated ``observer`` (uint8)."""
        w_qp = get_weight_observer(weight)().qparams(linear.weight.detach())
        return cls(linear.weight, w_qp, linear.bias, observer.qparams())

    def _range(self) -> tuple[float, int]:
        scale, zero_point = self.input_qparams.tolist()
        return scale, int(zero_point)

    def derive_buffers(self) -> None:
        super().derive_buffers()  # the weight sums, then (once the range is set) the bias of the rows that fit it
        if not hasattr(self, "input_qparams"):
            return
        self.register_buffer("fitted_bias", static_bias(self.weight_sums, self.weight_scale, self.bias,
                                                        *self._range()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.buffer
        return static_outliers_linear(x, b("qweight"), b("weight_scale"), b("bias"), b("fitted_bias"), *self._range(),
                                      input_scale=b("input_scale"))

    def extra_repr(self) -> str:
        scale, zero_point = self._range()
        return f"{super().extra_repr()}, range_scale={scale:.4g}, zero_point={zero_point}"


class WeightOnlyInt8Linear(SchemeLinear):
    """INT8 weights, float activations (``QuantConfig(scheme="weight_only")``, W8A16). With ``weight="per_channel"``
    each output's weights have one scale per :data:`~fxquant.kernels.weight_only.GROUP` inputs (where that many
    divide them; else one per output): the GEMM is float, so finer scales cost only their bytes."""

    scheme = "weight_only"
    kernel = "weight-only loop"

    @classmethod
    def from_float(cls, linear: nn.Linear, weight: str) -> SchemeLinear:
        out_features, in_features = linear.weight.shape
        if weight != "per_channel" or in_features % GROUP:
            return super().from_float(linear, weight)
        groups = linear.weight.detach().reshape(out_features * in_features // GROUP, GROUP)
        grouped = get_weight_observer("per_channel")().qparams(groups)
        module = cls(groups, grouped, linear.bias)  # quantized as rows of GROUP inputs, then given the Linear's shape
        module.out_features, module.in_features = out_features, in_features
        module.qweight = module.qweight.view(out_features, in_features)
        module.weight_scale = module.weight_scale.view(out_features, in_features // GROUP)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.buffer
        return weight_only_linear(x, b("qweight"), b("weight_scale"), b("bias"), input_scale=b("input_scale"))


SCHEME_MODULES: dict[str, type[SchemeLinear]] = {"dynamic": DynamicInt8Linear,
                                                      "dynamic_group": DynamicGroupInt8Linear,
                                                      "static_outliers": StaticOutliersInt8Linear,
                                                      "weight_only": WeightOnlyInt8Linear}

"""SmoothQuant's scales, and the automatic per-layer alpha (``QuantConfig(smoothquant_alpha="auto")``).

Why per layer: one alpha for every Linear helps some layers and hurts others. Measured on all-MiniLM-L6-v2 (fake-quant
Linears with float outputs, docs/accuracy.md): no smoothing 0.9930 mean cosine, alpha=0.5 everywhere 0.9882 (worse),
alpha=0.7 on the FFN Linears only 0.9968. The best alpha depends on how large a group's outlier channels are compared
with its weights, so it is chosen per *smoothing group* (the Linears reading one value, which share one ``s``).

How: during calibration the group's :class:`~fxquant.passes.ChannelRangeObserver` also keeps a uniform random sample
of at most :data:`SAMPLE_ROWS` input rows (a bottom-k reservoir on random keys: bounded, needs no second pass over the
data, and two reservoirs merge exactly like min/max do). Memory: ``SAMPLE_ROWS x in_features`` float32 per group, e.g.
256 x 1536 x 4 B = 1.5 MiB for a BERT-base-sized FFN down-projection input; the rows are saved with the other
observer statistics. At convert, each candidate (no smoothing, then every alpha of :data:`AUTO_ALPHAS`) fake-quantizes
the sampled rows as convert would: the smoothed value per tensor on uint8 over the range recomputed from the *full*
per-channel statistics, every weight ``W * s`` with its layer's int8 weight scheme. The candidate with the smallest
mean relative output error ``||Q(X/s) Q(W s)^T - X W^T||^2 / ||X W^T||^2`` over the group's layers wins (ties go to
the earlier candidate: no smoothing, then the smaller alpha). For a group of ``static_outliers`` Linears
(``outlier_tokens=True``) the candidates are simulated as that scheme runs: the range spans the calibration half's
ordinary tokens (:func:`~fxquant.passes.token_ranges.ordinary_rows`), and a new row outside it is quantized
symmetrically with its own scale. The choice assumes 8-bit activations; a backend using
7-bit ones (fbgemm without VNNI) would favour slightly more smoothing. Output rounding is left out: smoothing does not
change a Linear's float output, so it costs every candidate about the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxquant.observers.registry import get_weight_observer
from fxquant.passes.token_ranges import ordinary_rows
from fxquant.qparams import QParams, affine_qparams, fake_quantize

AUTO = "auto"
AUTO_ALPHAS: tuple[float, ...] = tuple(round(0.1 + 0.05 * i, 2) for i in range(17))  # 0.1, 0.15, ..., 0.9
SAMPLE_ROWS = 256
MIN_SAMPLES = 16  # fewer rows than this say nothing reliable about an alpha
SMOOTHQUANT_KEY = "fxquant_smoothquant"  # in GraphModule.meta: layer path -> SmoothingChoice


@dataclass(frozen=True)
class SmoothingChoice:
    """What SmoothQuant did to the group of Linears reading one value.

    ``alpha`` is ``None`` when the group was left unsmoothed (auto found no alpha that lowers its error).
    ``errors`` maps each auto candidate (``None`` = no smoothing) to its mean relative output error; empty for a
    fixed alpha.
    """

    layers: tuple[str, ...]
    alpha: float | None
    errors: Mapping[float | None, float] = field(default_factory=dict)


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha)``; channels that are all zero on either side keep s = 1."""
    live = (act_absmax > 0) & (weight_absmax > 0)
    tiny = torch.finfo(torch.float32).tiny
    scales = act_absmax.clamp(min=tiny).pow(alpha) / weight_absmax.clamp(min=tiny).pow(1.0 - alpha)
    return torch.where(live, scales, torch.ones_like(scales))


def keep_smallest_keys(rows: torch.Tensor, keys: torch.Tensor, new_rows: torch.Tensor, new_keys: torch.Tensor) -> None:
    """Keep (in place) the ``len(keys)`` rows with the smallest keys among the stored and the new ones.

    With uniform random keys this is a uniform sample without replacement of every row ever offered; unfilled
    slots hold ``inf`` keys. Merging two reservoirs is the same operation.
    """
    all_keys = torch.cat([keys, new_keys])
    best, index = torch.topk(all_keys, keys.numel(), largest=False)
    rows.copy_(torch.cat([rows, new_rows.to(rows.dtype)])[index])
    keys.copy_(best)


def sample_rows(rows: torch.Tensor, keys: torch.Tensor, x: torch.Tensor, seed: int) -> None:
    """Offer the rows of ``x`` (features on the last axis) to the reservoir ``rows``/``keys``.

    The keys come from a generator seeded with ``seed`` (the batch index), so calibration is reproducible and a
    resumed run continues as an uninterrupted one would.
    """
    flat = x.reshape(-1, rows.shape[1])
    new_keys = torch.rand(flat.shape[0], generator=torch.Generator().manual_seed(seed))
    new_keys, picked = torch.topk(new_keys, min(keys.numel(), flat.shape[0]), largest=False)
    keep_smallest_keys(rows, keys, flat[picked].float(), new_keys)


def _fake_quant_weight(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    return fake_quantize(weight, get_weight_observer(scheme)().qparams(weight))


def _outliers_fake_quant(rows: torch.Tensor, qp: QParams) -> torch.Tensor:
    """``rows`` as the ``static_outliers`` scheme computes them: a row within ``qp``'s range on it, any other row
    symmetrically on [-127, 127] with its own scale."""
    low, high = (qp.qmin - qp.zero_point) * qp.scale, (qp.qmax - qp.zero_point) * qp.scale
    fits = (rows.amin(dim=1) >= low) & (rows.amax(dim=1) <= high)
    own = rows.abs().amax(dim=1, keepdim=True).div(127.0).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(fits[:, None], fake_quantize(rows, qp), torch.round(rows / own).clamp(-127, 127) * own)


def _fold_error(calibration: torch.Tensor, new: torch.Tensor, layers: Sequence[tuple[torch.Tensor, str]],
                alpha: float | None, outlier_tokens: bool) -> list[float]:
    """Each layer's relative output error on ``new`` rows when ``calibration`` rows set the scales and the range."""
    act_absmax = calibration.abs().amax(dim=0)
    weight_absmax = torch.stack([w.abs().amax(dim=0) for w, _ in layers]).amax(dim=0)
    scales = torch.ones_like(act_absmax) if alpha is None else smoothing_scales(act_absmax, weight_absmax, alpha)
    if outlier_tokens:
        ranged = calibration[ordinary_rows(calibration)] / scales
        x_hat = _outliers_fake_quant(new / scales, affine_qparams(ranged.min(), ranged.max()))
    else:
        smoothed = calibration / scales
        x_hat = fake_quantize(new / scales, affine_qparams(smoothed.min(), smoothed.max()))
    errors = []
    for weight, scheme in layers:
        reference = new @ weight.T
        output = x_hat @ _fake_quant_weight(weight * scales, scheme).T
        power = reference.pow(2).sum().clamp(min=torch.finfo(torch.float32).tiny)
        errors.append(float((output - reference).pow(2).sum() / power))
    return errors


def candidate_error(rows: torch.Tensor, layers: Sequence[tuple[torch.Tensor, str]], alpha: float | None, *,
                    outlier_tokens: bool = False) -> float:
    """Held-out mean relative output error of the group's layers when their input is smoothed with ``alpha``.

    ``layers`` holds each weight with its weight scheme (``"per_channel"``/``"per_tensor"``); ``alpha=None`` is no
    smoothing. Two-fold: one half of ``rows`` plays the calibration data (its scales ``s`` and its per-tensor range),
    the other the new data, and back. Evaluated on the rows that set the range, an alpha that brings every channel to
    the range's edge looks free; on new data those channels clip (docs/accuracy.md, "Automatic per-layer alpha",
    measures the in-sample and the two-fold choice on new rows). ``outlier_tokens``: the layers run the
    ``static_outliers`` scheme (see the module docstring).
    """
    half = rows.shape[0] // 2
    errors = [*_fold_error(rows[:half], rows[half:], layers, alpha, outlier_tokens),
              *_fold_error(rows[half:], rows[:half], layers, alpha, outlier_tokens)]
    return sum(errors) / len(errors)


@torch.no_grad()
def choose_alpha(rows: torch.Tensor, layers: Sequence[tuple[torch.Tensor, str]],
                 alphas: Sequence[float] = AUTO_ALPHAS, *,
                 outlier_tokens: bool = False) -> tuple[float | None, dict[float | None, float]]:
    """The candidate (``None`` = no smoothing, or an alpha) with the smallest :func:`candidate_error`, and all errors.

    Example (one Linear, rows with an outlier channel)::

        x = torch.randn(256, 16); x[:, 0] *= 80
        alpha, errors = choose_alpha(x, [(torch.randn(8, 16), "per_channel")])
    """
    candidates: tuple[float | None, ...] = (None, *alphas)
    errors = {alpha: candidate_error(rows, layers, alpha, outlier_tokens=outlier_tokens) for alpha in candidates}
    finite = {key: value for key, value in errors.items() if math.isfinite(value)}
    best = min(finite, key=lambda key: finite[key]) if finite else None
    return best, errors


def _metas(model: nn.Module) -> Iterator[dict[str, Any]]:
    """The ``meta`` of every GraphModule in ``model``, and of every INT8 Linear taken out of its island (which
    brought its island's along: :func:`~fxquant.passes.schemes.unwrap_layer_islands`)."""
    for module in model.modules():
        meta = getattr(module, "meta", None)
        if isinstance(meta, dict):
            yield meta


def smoothing_choices(model: nn.Module) -> dict[str, SmoothingChoice]:
    """Layer path -> :class:`SmoothingChoice` for every Linear SmoothQuant considered in ``model``.

    ``model`` is a converted model (or ``fxquant.api.apply_statistics(prepared)``); INT8 islands inside an
    untraceable model are included, with their full paths. Example::

        qmodel = fxquant.quantize(model, (x,), data, QuantConfig(smoothquant_alpha="auto"))
        print(smoothquant_alphas(qmodel))   # {'fc2': 0.55, 'q': None, ...}
    """
    choices: dict[str, SmoothingChoice] = {}
    for meta in _metas(model):
        choices.update(meta.get(SMOOTHQUANT_KEY, {}))
    return dict(sorted(choices.items()))


def smoothquant_alphas(model: nn.Module) -> dict[str, float | None]:
    """Layer path -> the alpha its input was smoothed with (``None``: unsmoothed); see :func:`smoothing_choices`."""
    return {path: choice.alpha for path, choice in smoothing_choices(model).items()}

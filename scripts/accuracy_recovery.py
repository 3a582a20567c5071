"""Evidence for the accuracy-recovery tools (issue 8), every number in one run.

    python scripts/accuracy_recovery.py            # about a minute or two on 2 cores

1. SmoothQuant: a BERT-style encoder with planted activation outliers (a few hidden channels 60-100x larger),
   INT8 output SQNR with plain per-tensor activations vs ``smoothquant_alpha``.
2. Cross-layer equalization + bias correction: a shallow MobileNetV2-style network with deliberately unbalanced
   depthwise channels, per-tensor weights.
3. Accuracy-budget fallback: the digits CNN trained on real data, a 0.5-point budget; then the same search on a
   copy made outlier-heavy (and per-tensor weights) so that INT8 misses the budget.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch import nn

import fxquant
from fxquant import QuantConfig
from fxquant.fallback import FALLBACK_KEY
from fxquant.models import accuracy, create_model, digits_loader, train_digits_cnn
from fxquant.models.bert_style import EncoderLayer
from fxquant.qparams import sqnr_db

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


def smoothquant_evidence() -> None:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 1000, (8, BERT["seq_len"]), generator=generator) for _ in range(9)]
    calibration, test = tokens[:8], tokens[8]
    print("\n## SmoothQuant: INT8 output SQNR (dB) of a BERT-style encoder with planted outlier channels")
    print("| layout | outlier factor | plain per-tensor | alpha=0.5 | alpha=0.8 | gain at 0.5 |")
    print("|---|---|---|---|---|---|")
    for pre_ln, factor in ((True, 1.0), (True, 60.0), (True, 100.0), (False, 60.0)):
        model = bert(pre_ln, factor)
        plain = output_sqnr(model, QuantConfig(), calibration, test)
        smooth = [output_sqnr(model, QuantConfig(smoothquant_alpha=a), calibration, test) for a in (0.5, 0.8)]
        layout = "pre-LN (norms feed only Linears)" if pre_ln else "post-LN zoo model (residual adds int8)"
        print(f"| {layout} | {factor:g}x | {plain:.2f} | {smooth[0]:.2f} | {smooth[1]:.2f} | "
              f"{smooth[0] - plain:+.2f} |")


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
    for block in model.features[1:-1]:  # the inverted residuals
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
    rows = {"per_tensor": QuantConfig(weight="per_tensor"),
            "per_tensor + bias_correction": QuantConfig(weight="per_tensor", bias_correction=True),
            "per_tensor + equalize": QuantConfig(weight="per_tensor", equalize=True),
            "per_tensor + equalize + bias_correction": QuantConfig(weight="per_tensor", equalize=True,
                                                                   bias_correction=True),
            "per_channel (reference)": QuantConfig()}
    for name, config in rows.items():
        print(f"| {name} | {output_sqnr(model, config, calibration, test):.2f} |")


@torch.no_grad()
def outlier_heavy_digits(model: nn.Module, factor: float = 100.0) -> nn.Module:
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

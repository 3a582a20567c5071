"""Which modules are weight-bearing layers: what partial tracing looks for and what coverage must list.

A layer is a module whose weight feeds a matmul or a convolution (``nn.Linear``, the convolutions, their
subclasses, transformers' ``Conv1D``, ``nn.MultiheadAttention``'s projections) or a lookup (``nn.Embedding``), which
has a weight but no multiply-adds. transformers is never imported: its ``Conv1D`` is recognised by its shape.
"""

from __future__ import annotations

from torch import nn

from fxquant.nn.fused import COMPUTE_TYPES

LOOKUP_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)


def is_transposed_linear(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2, GPT-J's ancestors): ``x @ weight + bias`` with ``weight`` stored (in, out)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, nn.Parameter) and weight.dim() == 2 \
        and getattr(module, "nf", None) == weight.shape[1]


def as_linear(conv1d: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` that computes what a transformers ``Conv1D`` computes, over a transposed view of the same
    parameter (no copy): ``F.linear`` then makes the very ``addmm`` call ``Conv1D`` makes, so results are equal bit
    for bit."""
    weight, bias = conv1d.get_parameter("weight"), getattr(conv1d, "bias", None)
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.t(), requires_grad=weight.requires_grad)
    linear.register_parameter("bias", bias if isinstance(bias, nn.Parameter) else None)
    return linear


def layer_kind(module: nn.Module) -> str | None:
    """The kind of layer ``module`` is (``"Linear"``, ``"Conv2d"``, ``"Conv1D"``, ``"MultiheadAttention"``,
    ``"Embedding"`` ...; a subclass reports the torch class it extends), or None for any other module."""
    if is_transposed_linear(module):
        return "Conv1D"
    for base in (*COMPUTE_TYPES, nn.MultiheadAttention, *LOOKUP_TYPES):
        if isinstance(module, base):
            return base.__name__
    return None


def quantizable(module: nn.Module) -> bool:
    """A layer fxquant runs as INT8: the Linear and convolution classes, their subclasses, transformers' Conv1D."""
    return is_transposed_linear(module) or isinstance(module, COMPUTE_TYPES)


def holds_quantizable(module: nn.Module) -> bool:
    """Whether ``module`` is or holds a :func:`quantizable` layer, not counting the projections inside
    ``nn.MultiheadAttention`` (one float op computes them)."""
    stack = [module]
    while stack:
        current = stack.pop()
        if quantizable(current):
            return True
        if not isinstance(current, nn.MultiheadAttention):
            stack.extend(current.children())
    return False

"""Let a concatenation's inputs share its output qparams, so the int8 ``cat`` only copies.

Each input of a ``torch.cat`` otherwise keeps the qparams of its own observer and the int8 cat requantizes every
input to the output's (torch's ``quantized::cat``: a dequantize-quantize pass over each input, where a copy would do;
docs/quantization.md, "Fewest boundaries", has the cost). Where every input is an observed value (the output of an
int8 layer, or a float value entering int8) read by no other concatenation, those observers take the cat's output
qparams instead: the producers write directly on the cat's grid, as in torch.ao FX, whose cat shares one observer
with its inputs. The cat's observer saw the union of its inputs, so their ranges are covered; other readers of an
input (a pool beside the skip) read it with the shared qparams too.
"""

from __future__ import annotations

from torch import fx, nn

from fxquant.observers import Observer
from fxquant.passes._graph import only_user
from fxquant.passes.patterns import OpKind, classify, join_inputs
from fxquant.qparams import QParams


def _observer(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    return node.op == "call_module" and isinstance(modules.get(str(node.target)), Observer)


def _joins(node: fx.Node, modules: dict[str, nn.Module]) -> int:
    return sum(classify(user, modules) is OpKind.JOIN for user in node.users)


def share_join_qparams(gm: fx.GraphModule, modules: dict[str, nn.Module],
                       qparams: dict[str, QParams]) -> dict[str, QParams]:
    """Update ``qparams`` (observer name -> qparams, from ``observer_qparams``) in place and return it."""
    for node in gm.graph.nodes:
        if classify(node, modules) is not OpKind.JOIN:
            continue
        out, values = only_user(node), join_inputs(node)
        if out is None or not _observer(out, modules) or not values:
            continue
        if not all(_observer(v, modules) and _joins(v, modules) == 1 for v in values):
            continue
        shared = qparams[str(out.target)]
        if all((qparams[str(v.target)].qmin, qparams[str(v.target)].qmax) == (shared.qmin, shared.qmax)
               for v in values):
            for value in values:
                qparams[str(value.target)] = shared
    return qparams

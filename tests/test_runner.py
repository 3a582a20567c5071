"""``fxquant.runtime.runner``: a converted model's forward walks its graph instead of running torch.fx's generated
code, and must compute exactly what that code computes, whatever users do to the model afterwards. (The float loops
the walk takes for add + LayerNorm pairs compute the same function to float32 rounding: they have tests of their
own, tests/runtime/test_runtime_add_norm.py; here they step aside, so the walk itself is held to the bit.)"""

from __future__ import annotations

import copy
import inspect
import weakref

import pytest
import torch
from torch import fx, nn

import fxquant
from fxquant.kernels.registry import available_backends
from fxquant.models import create_model, example_inputs
from fxquant.runtime import add_norm, runner
from fxquant.runtime.runner import GraphRunner, install

BACKENDS = [b for b in ("onednn", "fbgemm", "reference") if b in available_backends()]


def _converted(name: str, backend: str) -> fx.GraphModule:
    # control_flow's negative branch never runs on this data (see docs/benchmarks.md): it stays float
    config = fxquant.QuantConfig(exclude=["gated.negative"] if name == "control_flow" else [])
    prepared = fxquant.prepare(create_model(name), example_inputs(name, 1), config)
    fxquant.calibrate(prepared, [example_inputs(name, 4, seed=s) for s in range(2)], progress=False)
    return fxquant.convert(prepared, backend=backend)


def _generated(gm: fx.GraphModule, *args: object) -> object:
    """What the code torch.fx generated for ``gm`` computes."""
    return type(gm).forward(gm, *args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["mobilenetv2", "bert_style", "unet", "control_flow"])
def test_the_runner_computes_what_the_generated_code_computes(name: str, backend: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(add_norm, "fused", lambda a, b, norm: None)
    qmodel = _converted(name, backend)
    assert isinstance(qmodel.forward, GraphRunner)
    x = example_inputs(name, 2, seed=7)
    with torch.no_grad():
        assert torch.equal(qmodel(*x), _generated(qmodel, *x))


def test_int8_islands_inside_untraceable_blocks_get_runners_too() -> None:
    """control_flow's gated block does not trace; its INT8 islands are GraphModules of their own."""
    qmodel = _converted("control_flow", "reference")
    islands = {path: m for path, m in qmodel.named_modules() if path and isinstance(m, fx.GraphModule)}
    assert islands and all(isinstance(m.forward, GraphRunner) for m in islands.values())
    inputs: dict[str, tuple[object, ...]] = {}
    handles = [m.register_forward_pre_hook(lambda module, args, path=path: inputs.setdefault(path, args))
               for path, m in islands.items()]
    with torch.no_grad():
        qmodel(*example_inputs("control_flow", 2, seed=3))
        for handle in handles:
            handle.remove()
        assert inputs
        for path, args in inputs.items():
            assert torch.equal(islands[path](*args), _generated(islands[path], *args)), path


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 2.0) -> torch.Tensor:
        y = self.fc(x) * scale
        return y if bias is None else y + bias


def test_keywords_and_defaults_bind_like_the_generated_signature() -> None:
    gm = install(fx.symbolic_trace(_Scaled(), concrete_args={"bias": None}))
    x = torch.randn(3, 8)
    assert torch.equal(gm(x), _generated(gm, x))
    assert torch.equal(gm(x, scale=3.0), _generated(gm, x, None, 3.0))
    assert torch.equal(gm(x=x, scale=0.5), _generated(gm, x, None, 0.5))
    with pytest.raises(TypeError):
        gm(x, nope=1)
    generated = list(inspect.signature(type(gm).forward).parameters)[1:]  # without self
    assert list(inspect.signature(gm.forward).parameters) == generated


def test_hooks_on_layers_and_global_hooks_still_run() -> None:
    qmodel = _converted("mlp", "reference")
    x = example_inputs("mlp", 2)[0]
    with torch.no_grad():
        plain = qmodel(x)
        seen: list[str] = []
        layer = next(m for n, m in qmodel.named_modules() if n and type(m).__name__.startswith("Quantized"))
        handle = layer.register_forward_hook(lambda module, args, out: seen.append("layer"))
        assert torch.equal(qmodel(x), plain) and seen == ["layer"]
        handle.remove()
        handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: seen.append("global"))
        try:
            assert torch.equal(qmodel(x), plain)
        finally:
            handle.remove()
        assert seen.count("global") >= 3  # every module call, the runner's layers included
        count = seen.count("global")
        assert torch.equal(qmodel(x), plain) and seen.count("global") == count  # removed: the direct calls again


def test_the_model_is_called_directly_unless_hooks_compile_or_tracing_need_module_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``qmodel(x)`` reaches the walk without ``nn.Module.__call__`` (its frames cost microseconds at batch 1); hooks
    on the model, a ``compile()``d call and ``torch.jit.trace`` still get that call, and no other class changes."""
    qmodel = _converted("mlp", "reference")
    x = example_inputs("mlp", 2)[0]
    reached: list[nn.Module] = []
    call_impl = nn.Module._call_impl

    def spy(module: nn.Module, *args: object, **kwargs: object) -> object:
        reached.append(module)
        return call_impl(module, *args, **kwargs)

    assert fx.GraphModule.__call__ is nn.Module.__call__ and type(qmodel).__call__ is not nn.Module.__call__
    with torch.no_grad():
        expected = _generated(qmodel, x)
        monkeypatch.setattr(nn.Module, "_call_impl", spy)
        plain = qmodel(x)
        assert not reached and torch.equal(plain, expected)
        seen: list[object] = []
        handles = [qmodel.register_forward_pre_hook(lambda module, args: seen.append("pre")),
                   qmodel.register_forward_hook(lambda module, args, out: seen.append(out))]
        assert torch.equal(qmodel(x), plain) and reached == [qmodel]
        assert seen[0] == "pre" and torch.equal(seen[1], plain)  # type: ignore[arg-type]
        for handle in handles:
            handle.remove()
        reached.clear()
        monkeypatch.setattr(qmodel, "_compiled_call_impl", lambda *args: "compiled")  # what compile() sets
        assert qmodel(x) == "compiled"
        gm = install(fx.symbolic_trace(_Scaled(), concrete_args={"bias": None}))
        small = torch.randn(3, 8)
        reached.clear()
        traced = torch.jit.trace(gm, (small,))
        assert reached[0] is gm and torch.equal(traced(small), _generated(gm, small))  # then its layer's call


def test_a_recompiled_graph_and_a_replaced_layer_are_followed() -> None:
    """Graph edits take effect at ``recompile()`` (as for the generated code), a layer swapped by ``setattr`` at
    once."""
    gm = install(fx.symbolic_trace(_Scaled(), concrete_args={"bias": None}))
    x = torch.randn(3, 8)
    before = gm(x)
    output = next(node for node in gm.graph.nodes if node.op == "output")
    with gm.graph.inserting_before(output):
        plus_one = gm.graph.call_function(torch.add, (output.args[0], 1.0))
    output.args = (plus_one,)
    gm.recompile()  # sets the class's __call__ to torch.fx's wrapper: the walk puts its own back when it sees it
    assert type(gm).__call__ is not runner._call and torch.equal(gm(x), before + 1)
    assert type(gm).__call__ is runner._call and torch.equal(gm(x), before + 1)
    gm.fc = nn.Linear(8, 4)
    assert torch.equal(gm(x), _generated(gm, x))


def test_a_deep_copy_computes_the_same() -> None:
    """``GraphModule.__deepcopy__`` rebuilds the module from its graph: the copy runs the generated code (same
    results) until the runner is installed on it too, and then runs its own layers."""
    qmodel = _converted("resnet18", "onednn")
    copied = copy.deepcopy(qmodel)
    x = example_inputs("resnet18", 1)
    with torch.no_grad():
        expected = qmodel(*x)
        assert torch.equal(copied(*x), expected)
        install(copied)
        assert isinstance(copied.forward, GraphRunner) and copied.forward.gm is copied
        assert torch.equal(copied(*x), expected)


class _Record(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = weakref.ref(x)
        return x * 2


class _Check(nn.Module):
    def __init__(self, record: _Record) -> None:
        super().__init__()
        self.record = [record]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive = self.record[0].seen() is not None
        return x + 1


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Record()
        self.second = _Record()
        self.check = _Check(self.second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.check(self.second(torch.relu(self.first(x)) - 1) * 3)


class _Leaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, (_Record, _Check)) or super().is_leaf_module(m, module_qualified_name)


def test_each_value_is_dropped_after_its_last_reader() -> None:
    """Intermediate tensors die when their last reader has run, not when the forward returns (memory at batch 32)."""
    chain = _Chain()
    gm = install(fx.GraphModule(chain, _Leaves().trace(chain)))
    gm(torch.randn(4, 4))
    assert gm.check.alive is False  # ``second``'s input was released before ``check`` ran


class _Variadic(nn.Module):
    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return xs[0] + xs[1]


def test_a_variadic_forward_keeps_the_generated_code() -> None:
    gm = install(fx.symbolic_trace(_Variadic()))
    assert not isinstance(gm.__dict__.get("forward"), GraphRunner)
    a, b = torch.randn(2), torch.randn(2)
    assert torch.equal(gm(a, b), a + b)

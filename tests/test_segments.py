"""``fxquant.runtime.replay``: runs of onednn steps recorded once and replayed as calls on raw addresses must compute
exactly what torch.fx's generated code computes, call after call, and step aside whenever the recording no longer
holds."""

from __future__ import annotations

import copy
import gc
import threading
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxquant
from fxquant import native
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.registry import available_backends
from fxquant.models import create_model, example_inputs
from fxquant.qparams import QParams
from fxquant.runtime import replay as segments
from fxquant.runtime.runner import install

pytestmark = pytest.mark.skipif("onednn" not in available_backends() or not onednn_direct.available(),
                                reason="needs the onednn backend on fxquant's own oneDNN primitives")


class _Net(nn.Module):
    """A max pool, residual blocks (conv + add fused), a depthwise conv, a value read after the convs (``skip``), a
    global average pool and a Linear, the flattened pool read after it too."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.a1, self.a2 = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.dw, self.pw = nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.Conv2d(16, 24, 1)
        self.fc = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = nn.functional.max_pool2d(torch.relu(self.stem(x)), 3, stride=2, padding=1)
        skip = torch.relu(self.a2(torch.relu(self.a1(y))) + y)
        z = self.pw(torch.relu(self.dw(skip)))
        features = torch.flatten(nn.functional.adaptive_avg_pool2d(z, 1), 1)
        return self.fc(features), features, skip


class _Flat(nn.Module):
    """Convs, a flatten that copies (channels-last values with positions), Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.f1, self.f2 = nn.Linear(8 * 6 * 6, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.f2(torch.relu(self.f1(torch.flatten(y, 1))))


def _converted(model: nn.Module, shape: tuple[int, ...]) -> fx.GraphModule:
    torch.manual_seed(0)
    prepared = fxquant.prepare(model.eval(), (torch.randn(shape),))
    fxquant.calibrate(prepared, [torch.randn(shape) for _ in range(3)], progress=False)
    return fxquant.convert(prepared, backend="onednn")


def _generated(gm: fx.GraphModule, *args: Any) -> Any:
    return type(gm).forward(gm, *args)


def _runs(gm: fx.GraphModule) -> list[segments.Run]:
    return [step[2] for step in gm.forward.plan.steps if step[1] == "run"]  # type: ignore[attr-defined]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


def test_replayed_runs_compute_the_generated_codes_bits_call_after_call() -> None:
    qmodel = _converted(_Net(), (2, 3, 16, 16))
    runs = _runs(qmodel)
    # the input's quantize to the residual blocks, whose output is dequantized (``skip``); the depthwise conv to the
    # global pool; the Linear follows the dequantize of the flattened features. Without the C loops the quantize and
    # the pools are torch ops: runs of layers alone.
    expected = [["Quantize", "QuantizedConv2d", "QuantizedPool", "QuantizedConv2d", "QuantizedConvAdd2d"],
                ["QuantizedConv2d", "QuantizedConv2d", "QuantizedPool"]]
    if not native.available():
        expected = [[kind for kind in run if kind.startswith("QuantizedConv")][-2:] for run in expected]
    assert [[type(qmodel.get_submodule(".".join(step.target))).__name__ for step in run.steps] for run in runs] == (
        expected)
    first, made = None, {}
    for seed, shape in enumerate([(2, 3, 16, 16), (2, 3, 16, 16), (1, 3, 20, 12), (2, 3, 16, 16), (1, 3, 20, 12)]):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        out = qmodel(x)
        assert _same(out, _generated(qmodel, x)), shape
        if first is None:
            first, kept = out, tuple(t.clone() for t in out)
        made.setdefault(shape, [id(r) for run in runs for r in run.recordings.values()])
    assert _same(first, kept)  # results handed out earlier are never reused as buffers
    recordings = [r for run in runs for r in run.recordings.values()]
    assert len(recordings) == 2 * len(runs) and all(r is not None for r in recordings)  # two input shapes
    # later calls replayed the recordings made on each layout's first call (no module changed: nothing re-recorded)
    assert set(made[(2, 3, 16, 16)]) <= set(map(id, recordings)) and set(made[(1, 3, 20, 12)]) == set(
        map(id, recordings))


def test_mobilenetv2_replays_its_convs_exactly() -> None:
    prepared = fxquant.prepare(create_model("mobilenetv2"), example_inputs("mobilenetv2", 1))
    fxquant.calibrate(prepared, [example_inputs("mobilenetv2", 2, seed=s) for s in range(2)], progress=False)
    qmodel = fxquant.convert(prepared, backend="onednn")
    (run,) = _runs(qmodel)  # one run from the input to the logits: quantize, 52 convs, pool, flatten, classifier
    if native.available():
        assert [step.op for step in qmodel.forward.plan.steps] == ["run"] and len(run.steps) == 56
    else:  # the quantize and the pool are torch ops: the convs alone
        assert len(run.steps) == 52
    for seed in range(3):
        (x,) = example_inputs("mobilenetv2", 1, seed=seed)
        with torch.inference_mode():
            assert torch.equal(qmodel(x), _generated(qmodel, x))
    assert all(recording is not None for recording in run.recordings.values())


def test_unet_replays_every_run_around_its_transposed_convs() -> None:
    """A transposed conv runs torch's float op on onednn: it stays out of runs, so the encoder's convs and pools
    replay as one run instead of all of them falling back."""
    prepared = fxquant.prepare(create_model("unet"), example_inputs("unet", 1))
    fxquant.calibrate(prepared, [example_inputs("unet", 1, seed=s) for s in range(2)], progress=False)
    qmodel = fxquant.convert(prepared, backend="onednn")
    (x,) = example_inputs("unet", 1, seed=5)
    for _ in range(3):
        assert torch.equal(qmodel(x), _generated(qmodel, x))
    runs = _runs(qmodel)
    assert runs and all(type(qmodel.get_submodule(".".join(step.target))).__name__ != "QuantizedConvTranspose2d"
                        for run in runs for step in run.steps if step.op == "call_module")
    assert all(list(run.recordings.values()) and None not in run.recordings.values() for run in runs)


@pytest.mark.skipif(not native.available(), reason="without the C loops no quantize joins a run")
def test_a_step_that_does_more_than_one_call_leaves_the_layers_their_own_runs() -> None:
    qmodel = _converted(_Flat(), (2, 3, 6, 6))
    (run,) = _runs(qmodel)
    assert [step.op for step in run.steps] == ["call_module"] * 3 + ["call_function"] + ["call_module"] * 2
    for seed in range(3):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(qmodel(x), _generated(qmodel, x))
        assert torch.equal(qmodel(x.double()), _generated(qmodel, x.double()))  # a quantize with no C loop
    assert list(run.recordings.values()) == [None, None]  # the flatten copied; the float64 quantize is torch ops
    assert run.narrow is not None
    layers = [step.target for step in run.narrow if step.op == "run"]  # as grouped before the extras joined
    assert [len(sub.steps) for sub in layers] == [2, 2]
    # both dtypes quantize to the same uint8 layout: one recording each, replayed
    assert all(len(sub.recordings) == 1 and None not in sub.recordings.values() for sub in layers)


def test_concurrent_callers_get_their_own_buffers() -> None:
    qmodel = _converted(_Net(), (1, 3, 16, 16))
    inputs = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    expected = [_generated(qmodel, x) for x in inputs]
    qmodel(inputs[0])  # recorded
    failures: list[int] = []

    def call(index: int) -> None:
        for _ in range(20):
            if not _same(qmodel(inputs[index]), expected[index]):
                failures.append(index)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_a_changed_layer_is_run_as_it_now_is() -> None:
    qmodel = _converted(_Net(), (1, 3, 16, 16))
    x = torch.randn(1, 3, 16, 16)
    qmodel(x), qmodel(x)  # recorded, replayed
    layer = qmodel.get_submodule("dw")
    scale, zero_point = layer.out_qp.scalar()
    layer.out_qp = QParams(torch.tensor(scale * 1.5), torch.tensor(zero_point), 0, 255)  # new qparams in place
    assert _same(qmodel(x), _generated(qmodel, x)) and _same(qmodel(x), _generated(qmodel, x))
    layer.out_qp = QParams(torch.tensor(scale), torch.tensor(zero_point), 0, 127)  # 7-bit: a clip in the primitive
    assert _same(qmodel(x), _generated(qmodel, x)) and _same(qmodel(x), _generated(qmodel, x))
    run = next(run for run in _runs(qmodel) if any(step[2] == ("dw",) for step in run.steps))
    assert None not in run.recordings.values()  # no clamp after the primitive: that layout still replays
    replacement = _converted(_Net(), (1, 3, 16, 16)).get_submodule("pw")
    qmodel.pw = replacement  # another layer object
    assert _same(qmodel(x), _generated(qmodel, x)) and _same(qmodel(x), _generated(qmodel, x))


def test_hooks_tracing_and_big_buffers_take_the_layer_by_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    qmodel = _converted(_Net(), (1, 3, 16, 16))
    x = torch.randn(1, 3, 16, 16)
    qmodel(x)
    seen: list[str] = []
    handle = qmodel.get_submodule("a1").register_forward_hook(lambda *_: seen.append("a1"))
    assert _same(qmodel(x), _generated(qmodel, x)) and seen == ["a1", "a1"]
    handle.remove()
    monkeypatch.setattr(segments, "ARENA_LIMIT", 0)
    y = torch.randn(2, 3, 16, 16)  # a new layout: recorded under the new limit, which nothing fits
    assert _same(qmodel(y), _generated(qmodel, y)) and _same(qmodel(y), _generated(qmodel, y))
    assert any(r is None for run in _runs(qmodel) for r in run.recordings.values())


def _pooled(run: segments.Run) -> int:
    return sum(block.numel() for recording in run.recordings.values() if recording is not None
               for block, _ in recording.pool)


def test_buffers_kept_between_calls_stay_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    qmodel = _converted(_Net(), (1, 3, 16, 16))
    x = torch.randn(1, 3, 16, 16)
    for _ in range(3):
        assert _same(qmodel(x), _generated(qmodel, x))
    runs = _runs(qmodel)
    assert all(run.kept == _pooled(run) > 0 for run in runs)  # one buffer each, kept
    qmodel.get_submodule("dw").relower(qmodel.get_submodule("dw").backend)  # re-recorded: the old buffer is let go
    for _ in range(2):
        assert _same(qmodel(x), _generated(qmodel, x))
    assert all(run.kept == _pooled(run) > 0 for run in runs)
    monkeypatch.setattr(segments, "KEPT_LIMIT", 0)
    y = torch.randn(2, 3, 16, 16)  # a new layout: its buffer is made for each call and freed after it
    for _ in range(3):
        assert _same(qmodel(y), _generated(qmodel, y))
    assert all(run.kept == _pooled(run) for run in runs)
    assert all(not r.pool for run in runs for key, r in run.recordings.items() if r is not None and key[1][0][0] == 2)


def test_values_alive_at_once_never_share_memory() -> None:
    """``_pack`` against a brute-force check of every pair of buffers (a mutation sharing all slots fails it)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        buffers = {}
        for b in range(12):
            first = int(torch.randint(0, 10, (1,), generator=generator))
            last = first + int(torch.randint(0, 4, (1,), generator=generator))
            buffers[b] = segments._Buffer(first, last, int(torch.randint(1, 5000, (1,), generator=generator)), False)
        offsets, total = segments._pack(buffers)
        for a, x in buffers.items():
            assert offsets[a] % 64 == 0 and offsets[a] + x.nbytes <= total
            for b, y in buffers.items():
                in_time = a != b and not (x.last < y.first or y.last < x.first)
                in_memory = offsets[a] < offsets[b] + y.nbytes and offsets[b] < offsets[a] + x.nbytes
                assert not (in_time and in_memory), (a, b, buffers, offsets)


def test_layouts_past_the_limit_run_layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "RECORDINGS_PER_RUN", 1)
    qmodel = _converted(_Net(), (1, 3, 16, 16))
    for shape in [(1, 3, 16, 16), (2, 3, 16, 16), (2, 3, 16, 16), (1, 3, 16, 16)]:
        x = torch.randn(shape)
        assert _same(qmodel(x), _generated(qmodel, x)), shape
    assert all(len(run.recordings) == 1 for run in _runs(qmodel))  # the first layout only


def test_a_deep_copy_records_its_own_buffers() -> None:
    qmodel = _converted(_Net(), (1, 3, 16, 16))
    x = torch.randn(1, 3, 16, 16)
    qmodel(x), qmodel(x)  # recorded, replayed: the runs hold buffers at this model's addresses
    (run, *_) = _runs(qmodel)
    twin = copy.deepcopy(run)
    assert not twin.recordings and twin.kept == 0 and twin.lock is not run.lock  # raw addresses are not copied
    copied = install(copy.deepcopy(qmodel))  # the copy runs the generated code until installed (architecture.md)
    del qmodel, run
    gc.collect()  # the original's buffers are gone
    expected = _generated(copied, x)
    for _ in range(3):
        assert _same(copied(x), expected)
    assert all(len(r.recordings) == 1 and None not in r.recordings.values() for r in _runs(copied))

"""Runs of oneDNN layers replayed as one recorded list of primitive calls (used by :mod:`fxquant.runtime.runner`).

Once each layer's kernel is a prebuilt primitive, what is left at small batches is around it: per layer a module
call, the bound-call lookup, a fresh output tensor from the allocator at a new address (docs/backends.md "Runs of
layers replayed" has the measurements). A run of consecutive Linear/Conv layers on the onednn backend (primitives
fxquant builds itself, :mod:`fxquant.kernels.onednn.direct`) is recorded on its first call for each input layout
and thread count: which primitive each layer executed, reading and writing which value. Later calls execute those
primitives on those values' addresses and nothing else. Values that stay inside the run live in one buffer kept
between calls, in slots shared by values whose lifetimes do not overlap (so they stay in cache); values read after
the run are fresh tensors on every call, as before.

A recording is replayed only while it still describes what the layers do; otherwise the layers run one by one:

* the same layer objects (found through ``_modules`` on every call, as the runner finds them) with the same
  attributes (every ``__dict__`` value, by identity: re-lowering, new qparams, a new packing all show);
* inputs of the recorded shapes, strides and dtypes, and the same ``torch.get_num_threads()``;
* no hooks on the layers, no global hooks, no tracing;
* each layer executed exactly one primitive, which read the layer's input where it was and wrote the layer's result
  (or, fused with an add, its accumulator) with nothing after it: a copy to another layout, a clamp, the torch op
  fallback or a copied accumulator leave that input layout to the layer-by-layer path.

The buffer is at most ``ARENA_LIMIT`` bytes (at large batches the per-layer costs are noise, and holding the
memory between calls would cost more than the replay gains).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx, nn

from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.nn.quantized import _QuantizedWeighted
from fxquant.runtime.step import Step

ARENA_LIMIT = 64 << 20
RECORDINGS_PER_RUN = 16  # input layouts x thread counts kept per run of layers (one each, typically)
_ALIGN = 64

RunLayer = Callable[[nn.Module, list[Any], bool], Any]  # a layer's ordinary call, as the runner makes it


def replayable(module: nn.Module) -> bool:
    """Whether ``module`` is a layer a run may hold: a Linear/Conv on the onednn backend with fxquant's own
    primitives."""
    return isinstance(module, _QuantizedWeighted) and module.backend.name == "onednn" and onednn_direct.available()


def _reads(step: Step) -> tuple[int, ...]:
    assert step.inputs is not None, "group() puts only steps whose arguments are all values into a run"
    return step.inputs


def _module(gm: nn.Module, path: tuple[str, ...]) -> nn.Module:
    module = gm
    for name in path:
        module = module._modules[name]  # type: ignore[assignment]
    return module


def _layout(value: Any) -> tuple[Any, ...]:
    return (value.shape, value.stride(), value.dtype) if isinstance(value, torch.Tensor) else (type(value),)


class _Buffer(NamedTuple):
    """A value's memory in a recording: where it is made (step position, -1 for the run's inputs) and last read."""

    first: int
    last: int
    nbytes: int
    escapes: bool


class _Recording(NamedTuple):
    modules: list[nn.Module]
    state_ids: tuple[tuple[int, ...], ...]
    kept: tuple[tuple[Any, ...], ...]  # the attribute values the ids belong to, alive so no id is reused
    inputs: tuple[int, ...]  # env slots of the run's inputs: buffers 0..len-1
    fresh: tuple[tuple[int, torch.Size, tuple[int, ...], torch.dtype], ...]  # buffers made on every call
    arena: tuple[tuple[int, int], ...]  # (buffer, offset) inside the kept buffer
    arena_bytes: int
    buffers: int
    calls: tuple[tuple[Callable[[int, int], None], int, int], ...]  # (primitive run, source buffer, destination)
    outputs: tuple[tuple[int, int], ...]  # (env slot, buffer) of the values read after the run
    pool: list[tuple[torch.Tensor, list[int]]]  # kept buffers not in use, with their buffers' addresses


class Run:
    """Consecutive runner steps that call onednn layers; called in the runner's place for all of them."""

    def __init__(self, steps: Sequence[Step], escaping: frozenset[int], run_layer: RunLayer) -> None:
        self.steps = tuple(steps)
        self.reads = tuple(_reads(step) for step in self.steps)  # each layer's argument slots
        self.escaping = escaping
        self.run_layer = run_layer
        produced = {step.slot for step in self.steps}
        inputs: dict[int, None] = {}
        for reads in self.reads:
            inputs.update((slot, None) for slot in reads if slot not in produced)
        self.inputs = tuple(inputs)
        self.recordings: dict[tuple[Any, ...], _Recording | None] = {}

    def __call__(self, env: list[Any], gm: nn.Module, plain: bool, hooked: Callable[[nn.Module], bool]) -> None:
        modules = [_module(gm, step.target) for step in self.steps]
        if not plain or any(map(hooked, modules)):
            self._one_by_one(env, modules, plain)
            return
        key = (torch.get_num_threads(), *(_layout(env[slot]) for slot in self.inputs))
        if key not in self.recordings and len(self.recordings) >= RECORDINGS_PER_RUN:
            self._one_by_one(env, modules, plain)  # too many layouts: the rest run as before
            return
        if key not in self.recordings or not _current(self.recordings[key], modules):
            self.recordings[key] = self._record(env, modules)
            return
        recording = self.recordings[key]
        if recording is None:
            self._one_by_one(env, modules, plain)
        else:
            _replay(recording, env)

    def _one_by_one(self, env: list[Any], modules: list[nn.Module], plain: bool) -> None:
        for module, step, reads in zip(modules, self.steps, self.reads, strict=True):
            env[step.slot] = self.run_layer(module, [env[i] for i in reads], plain)
            for dead in step.freed:
                env[dead] = None

    def _record(self, env: list[Any], modules: list[nn.Module]) -> _Recording | None:
        """Run the layers one by one (filling ``env``), recording their primitives; the recording, or None where
        some layer did more than execute one primitive in place."""
        values: dict[int, Any] = {slot: env[slot] for slot in self.inputs}
        executed: list[tuple[list[onednn_direct.Record], list[Any], Any]] = []
        with onednn_direct.recording() as log:
            for module, step, reads in zip(modules, self.steps, self.reads, strict=True):
                args = [values[i] for i in reads]
                start = len(log)
                values[step.slot] = self.run_layer(module, args, True)
                executed.append((log[start:], args, values[step.slot]))
        for slot in self.escaping:
            env[slot] = values[slot]
        return self._compile(modules, executed)

    def _compile(self, modules: list[nn.Module],
                 executed: list[tuple[list[onednn_direct.Record], list[Any], Any]]) -> _Recording | None:
        buffer_of = {slot: index for index, slot in enumerate(self.inputs)}
        made: dict[int, tuple[int, Any]] = {}  # buffer -> (position made, tensor)
        calls = []
        for position, ((records, args, out), step) in enumerate(zip(executed, self.steps, strict=True)):
            record = records[0] if len(records) == 1 else None
            if record is None or not isinstance(out, torch.Tensor):
                return None  # no primitive, several, or something after one (a clamp)
            run, source, destination, written = record
            if written is not out or source != args[0].data_ptr():
                return None  # the result is another tensor, or the input was copied first
            if len(args) == 2:  # conv + add: the sum is written into the accumulator
                if destination != args[1].data_ptr():
                    return None
                buffer = buffer_of[self.reads[position][1]]
            elif len(args) == 1:
                buffer = len(self.inputs) + len(made)
                made[buffer] = (position, out)
            else:
                return None
            buffer_of[step.slot] = buffer
            calls.append((run, buffer_of[self.reads[position][0]], buffer))
        buffers = self._buffers(buffer_of, made)
        arena, arena_bytes = _pack({b: buf for b, buf in buffers.items() if not buf.escapes})
        if arena_bytes > ARENA_LIMIT:
            return None
        kept = tuple(tuple(module.__dict__.values()) for module in modules)
        fresh = tuple((b, made[b][1].shape, made[b][1].stride(), made[b][1].dtype)
                      for b, buf in buffers.items() if buf.escapes)
        outputs = tuple((slot, buffer_of[slot]) for slot in sorted(self.escaping))
        return _Recording(list(modules), tuple(tuple(map(id, values)) for values in kept), kept, self.inputs, fresh,
                          tuple(arena.items()), arena_bytes, len(self.inputs) + len(made), tuple(calls), outputs, [])

    def _buffers(self, buffer_of: dict[int, int], made: dict[int, tuple[int, Any]]) -> dict[int, _Buffer]:
        """Lifetimes of the buffers the run makes: from the step making one to the last step reading any value in
        it (a sum writes a new value into its accumulator's buffer), or escaping if a value in it is read later."""
        last = {b: position for b, (position, _) in made.items()}
        escapes: set[int] = set()
        for position, reads in enumerate(self.reads):
            for slot in reads:
                last[buffer_of[slot]] = max(last.get(buffer_of[slot], -1), position)
        for slot in self.escaping:
            escapes.add(buffer_of[slot])
        return {b: _Buffer(position, last[b], tensor.untyped_storage().nbytes(), b in escapes)
                for b, (position, tensor) in made.items()}


def _current(recording: _Recording | None, modules: list[nn.Module]) -> bool:
    """Whether the layers are the recorded objects with the recorded attributes (compared by identity); a layout
    that could not be recorded stays so."""
    if recording is None:
        return True
    return all(a is b for a, b in zip(modules, recording.modules, strict=True)) and all(
        tuple(map(id, module.__dict__.values())) == ids
        for module, ids in zip(modules, recording.state_ids, strict=True))


def _pack(buffers: dict[int, _Buffer]) -> tuple[dict[int, int], int]:
    """Offsets in one block for buffers that stay inside the run: a buffer takes the smallest slot big enough whose
    last value was read before the buffer is made (a primitive never writes where it reads), else a new slot."""
    slots: list[list[int]] = []  # [offset, size, last position read]
    offsets, end = {}, 0
    for b, buffer in sorted(buffers.items(), key=lambda item: item[1].first):
        free = [slot for slot in slots if slot[2] < buffer.first and slot[1] >= buffer.nbytes]
        if free:
            slot = min(free, key=lambda s: s[1])
        else:
            size = -(-buffer.nbytes // _ALIGN) * _ALIGN
            slot = [end, size, -1]
            slots.append(slot)
            end += size
        slot[2] = buffer.last
        offsets[b] = slot[0]
    return offsets, end


def _replay(recording: _Recording, env: list[Any]) -> None:
    """The recorded primitives on this call's inputs, fresh output tensors and a kept buffer not in use."""
    pool = recording.pool
    block, addresses = pool.pop() if pool else _block(recording)
    try:
        tensors: list[Any] = [None] * recording.buffers
        pointers = list(addresses)
        for buffer, slot in enumerate(recording.inputs):
            tensors[buffer] = env[slot]
            pointers[buffer] = env[slot].data_ptr()
        for buffer, shape, stride, dtype in recording.fresh:
            tensors[buffer] = torch.empty_strided(shape, stride, dtype=dtype)
            pointers[buffer] = tensors[buffer].data_ptr()
        for run, source, destination in recording.calls:
            run(pointers[source], pointers[destination])
    finally:
        pool.append((block, addresses))  # another thread may have used its own meanwhile: both are kept
    for slot, buffer in recording.outputs:
        env[slot] = tensors[buffer]


def _block(recording: _Recording) -> tuple[torch.Tensor, list[int]]:
    block = torch.empty(max(recording.arena_bytes, 1), dtype=torch.uint8)
    addresses = [0] * recording.buffers
    for buffer, offset in recording.arena:
        addresses[buffer] = block.data_ptr() + offset
    return block, addresses


def group(steps: list[Step], gm: fx.GraphModule, last_read: dict[int, int], run_layer: RunLayer) -> list[Step]:
    """``steps`` with every stretch of two or more consecutive onednn layer steps replaced by one ``Run`` step;
    ``last_read``: per slot, the position of the last step reading it (past the end for the graph's output)."""
    grouped: list[Step] = []
    stretch: list[Step] = []

    def close(end: int) -> None:
        if len(stretch) < 2:
            grouped.extend(stretch)
        else:
            produced = {step.slot for step in stretch}
            escaping = frozenset(slot for slot in produced if last_read.get(slot, -1) >= end)
            freed = tuple(slot for step in stretch for slot in step.freed if slot not in produced)
            grouped.append(Step(-1, "run", Run(stretch, escaping, run_layer), None, (), {}, freed))
        stretch.clear()

    for position, step in enumerate(steps):
        if step.op == "call_module" and step.inputs is not None and replayable(_module(gm, step.target)):
            stretch.append(step)
        else:
            close(position)
            grouped.append(step)
    close(len(steps))
    return grouped

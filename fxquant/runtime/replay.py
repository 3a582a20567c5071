"""Runs of oneDNN layers, with the int8 steps between them, replayed as one recorded list of calls on raw addresses
(used by :mod:`fxquant.runtime.runner`).

Once each layer's kernel is a prebuilt primitive, what is left at small batches is around it: per layer a module
call, the bound-call lookup, a fresh output tensor from the allocator at a new address (docs/backends.md "Runs of
layers replayed" has the measurements). A run of consecutive steps on the onednn backend is recorded on its first
call for each input layout and thread count: which C call each step executed (:mod:`fxquant.kernels.recording`),
reading and writing which value. A run holds Linear/Conv layers on primitives fxquant builds itself
(:mod:`fxquant.kernels.onednn.direct`), the quantize of its input, global average and max pools (fxquant's C
loops), and ``flatten``/``view``/``reshape`` between them, which only name the same memory again. Later calls
execute those calls on those values' addresses and nothing else. Values that stay inside the run live in one buffer
kept between calls, in slots shared by values whose lifetimes do not overlap (so they stay in cache); values read
after the run are fresh tensors on every call, as before.

A recording is replayed only while it still describes what the steps do; otherwise they run as before:

* the same module objects (found through ``_modules`` on every call, as the runner finds them), none of which has
  had an attribute set since (their ``generation``: re-lowering, new qparams, a new packing all show);
* inputs of the recorded shapes, strides and dtypes, and the same ``torch.get_num_threads()``;
* no hooks on the layers, no global hooks, no tracing;
* each step executed exactly one recorded call, which read the step's input where it was and wrote the step's
  result (or, fused with an add, its accumulator) with nothing after it, or (a view) made none and returned its
  input's memory for the run alone to read. A copy to another layout, a clamp, a torch op or a copied accumulator
  leave that input layout to the steps' earlier grouping: runs of layers alone, the other steps one by one.

One recording's buffer is at most ``ARENA_LIMIT`` bytes: large batches need it most, since a fresh tensor above
glibc's 32 MB mmap threshold is new pages, faulted in and zeroed, on every call (MobileNetV2's 38.5 MB expansion at
batch 32), but no layout should hold gigabytes. The buffers one run keeps between calls, for all its layouts and
concurrent callers, are at most ``KEPT_LIMIT`` bytes; past it a buffer is made for its call and freed after it.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fxquant import native
from fxquant.kernels import recording
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.nn.quantized import Quantize, QuantizedConvNd, QuantizedLinear, QuantizedPool
from fxquant.runtime.step import Step, execute, hooked, module_at, reads

ARENA_LIMIT = 256 << 20
KEPT_LIMIT = 1 << 30
RECORDINGS_PER_RUN = 16  # input layouts x thread counts kept per run (one each, typically)
_ALIGN = 64
_UNSEEN: Any = object()  # a layout not recorded yet
_VIEW_METHODS = frozenset({"flatten", "view", "reshape"})
_VIEW_FUNCTIONS = (torch.flatten, torch.reshape)


def replayable(module: nn.Module) -> bool:
    """Whether ``module`` is a layer a run may hold: a Linear/Conv on the onednn backend with fxquant's own
    primitives (a transposed conv runs torch's float op there: it would only make its run fall back)."""
    return (isinstance(module, (QuantizedLinear, QuantizedConvNd)) and module.backend.name == "onednn"
            and onednn_direct.available())


def _records_its_call(module: nn.Module) -> bool:
    """Whether ``module`` is another int8 step whose work is one C call it records: the quantize into the onednn
    backend's activations, a global average pool, a max pool, where fxquant's C loops are on (inputs their loops do
    not take leave the run to the earlier grouping)."""
    if not (isinstance(module, (Quantize, QuantizedPool)) and module.backend.name == "onednn"
            and onednn_direct.available() and native.available()):
        return False
    return isinstance(module, Quantize) or module.kind in ("adaptive_avg", "max")


def _kind(step: Step, gm: nn.Module, extras: bool) -> str | None:
    """How ``step`` may join a run: "layer", "call" (:func:`_records_its_call`), "view", or None."""
    if step.op == "call_module" and step.inputs is not None:
        module = module_at(gm, step.target)
        if replayable(module):
            return "layer"
        return "call" if extras and _records_its_call(module) else None
    views = extras and ((step.op == "call_method" and step.target in _VIEW_METHODS)
                        or (step.op == "call_function" and any(step.target is f for f in _VIEW_FUNCTIONS)))
    return "view" if views else None


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
    generations: list[int]  # of the modules (fxquant.nn.quantized._BackendModule)
    inputs: tuple[int, ...]  # env slots of the run's inputs: buffers 0..len-1
    fresh: tuple[tuple[int, torch.Size, tuple[int, ...], torch.dtype], ...]  # buffers made on every call
    arena: tuple[tuple[int, int], ...]  # (buffer, offset) inside the kept buffer
    arena_bytes: int
    buffers: int
    calls: tuple[tuple[recording.AddressCall, int, int], ...]  # (recorded call, source buffer, destination)
    outputs: tuple[tuple[int, int], ...]  # (env slot, buffer) of the values read after the run
    pool: list[tuple[torch.Tensor, list[int]]]  # kept buffers not in use, with their buffers' addresses


class Run:
    """Consecutive runner steps on the onednn backend (see the module docstring); called in the runner's place for
    all of them."""

    def __init__(self, steps: Sequence[Step], escaping: frozenset[int], gm: nn.Module) -> None:
        self.steps = tuple(steps)
        self.reads = tuple(reads(step) for step in self.steps)  # each step's argument slots
        self.escaping = escaping
        self.extras = any(_kind(step, gm, False) != "layer" for step in self.steps)  # anything but layers
        produced = {step.slot for step in self.steps}
        inputs: dict[int, None] = {}
        for slots in self.reads:
            inputs.update((slot, None) for slot in slots if slot not in produced)
        self.inputs = tuple(inputs)
        self.paths = tuple(step.target for step in self.steps if step.op == "call_module")  # the modules' paths
        self.recordings: dict[tuple[Any, ...], _Recording | None] = {}
        self.narrow: list[Step] | None = None  # the steps as grouped without the extras, made when first needed
        self.kept = 0  # bytes of the buffers the recordings keep, in their pools or in a call
        self.lock = threading.Lock()  # over ``kept``

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy`` of the model, pickling) records anew: a recording holds raw addresses of this
        run's buffers, which a copy of them would not be at."""
        state = dict(self.__dict__, recordings={}, narrow=None, kept=0)
        del state["lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def __call__(self, env: list[Any], gm: nn.Module, plain: bool) -> None:
        # One flat function on purpose, as is _replay: at batch 1 the caches are cold on a call (other work ran
        # since), and there every Python frame and generator on this path costs microseconds (docs/backends.md,
        # "The graph walk", has the measurement).
        modules = []
        for path in self.paths:
            module = gm
            for name in path:
                module = module._modules[name]  # type: ignore[assignment]
            modules.append(module)
            plain = plain and not hooked(module)
        if not plain:
            _walk(self.steps, env, gm, plain)
            return
        layouts: list[Any] = [torch.get_num_threads()]
        for slot in self.inputs:
            value = env[slot]
            layouts.append((value.shape, value.stride(), value.dtype) if isinstance(value, torch.Tensor)
                           else (type(value),))
        key = tuple(layouts)
        recording = self.recordings.get(key, _UNSEEN)  # one lookup: hashing the layouts is most of a check's cost
        if (isinstance(recording, _Recording) and all(map(operator.is_, recording.modules, modules))
                and recording.generations == [module.generation for module in modules]):
            self._replay(recording, env)
        elif recording is _UNSEEN and len(self.recordings) >= RECORDINGS_PER_RUN:
            _walk(self.steps, env, gm, plain)  # too many layouts: the rest run as before
        elif recording is _UNSEEN or recording is not None:  # not seen, or the modules changed since
            self.recordings[key] = self._record(env, gm, modules)
            if recording is not _UNSEEN:  # its kept buffers are let go with it
                with self.lock:
                    self.kept -= sum(block.numel() for block, _ in recording.pool)
        elif self.extras:  # some step did more than one recorded call: runs of the layers alone may still replay
            _walk(self._narrowed(gm), env, gm, plain)
        else:
            _walk(self.steps, env, gm, plain)

    def _narrowed(self, gm: nn.Module) -> list[Step]:
        if self.narrow is None:
            last_read: dict[int, int] = {}
            for position, slots in enumerate(self.reads):
                last_read.update((slot, position) for slot in slots)
            last_read.update((slot, len(self.steps)) for slot in self.escaping)
            self.narrow = group(list(self.steps), gm, last_read, extras=False)
        return self.narrow

    def _record(self, env: list[Any], gm: nn.Module, modules: list[nn.Module]) -> _Recording | None:
        """Run the steps one by one (filling ``env``), recording their calls; the recording, or None where some
        step did more than one recorded call in place."""
        values: dict[int, Any] = {slot: env[slot] for slot in self.inputs}
        executed: list[tuple[list[recording.Record], list[Any], Any]] = []
        with recording.recording() as log:
            for step, slots in zip(self.steps, self.reads, strict=True):
                args = [values[i] for i in slots]
                start = len(log)
                values[step.slot] = execute(step, values, gm, True)
                executed.append((log[start:], args, values[step.slot]))
        for slot in self.escaping:
            env[slot] = values[slot]
        return self._compile(modules, executed)

    def _compile(self, modules: list[nn.Module],
                 executed: list[tuple[list[recording.Record], list[Any], Any]]) -> _Recording | None:
        buffer_of = {slot: index for index, slot in enumerate(self.inputs)}
        made: dict[int, tuple[int, Any]] = {}  # buffer -> (position made, tensor)
        calls = []
        for position, ((records, args, out), step) in enumerate(zip(executed, self.steps, strict=True)):
            if not isinstance(out, torch.Tensor):
                return None
            if step.op != "call_module":  # a view: no call, the same memory under another shape
                if (records or len(args) != 1 or out.data_ptr() != args[0].data_ptr() or out.dtype != args[0].dtype
                        or step.slot in self.escaping):
                    return None  # it copied, or it is read after the run (its buffer would need its own shape)
                buffer_of[step.slot] = buffer_of[self.reads[position][0]]
                continue
            record = records[0] if len(records) == 1 else None
            if record is None:
                return None  # no recorded call, several, or something after one (a clamp)
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
        fresh = tuple((b, made[b][1].shape, made[b][1].stride(), made[b][1].dtype)
                      for b, buf in buffers.items() if buf.escapes)
        outputs = tuple((slot, buffer_of[slot]) for slot in sorted(self.escaping))
        return _Recording(list(modules), _generations(modules), self.inputs, fresh, tuple(arena.items()), arena_bytes,
                          len(self.inputs) + len(made), tuple(calls), outputs, [])

    def _replay(self, recording: _Recording, env: list[Any]) -> None:
        """The recorded calls on this call's inputs, fresh output tensors and a kept buffer not in use (``pop`` and
        ``append`` on the pool are atomic: concurrent callers never get the same buffer)."""
        pool = recording.pool
        try:
            block, addresses = pool.pop()
            keep = True
        except IndexError:
            block, addresses, keep = self._new_block(recording)
        try:
            pointers = addresses.copy()
            tensors: list[Any] = [None] * recording.buffers
            for buffer, slot in enumerate(recording.inputs):
                value = tensors[buffer] = env[slot]
                pointers[buffer] = value.data_ptr()
            for buffer, shape, stride, dtype in recording.fresh:
                value = tensors[buffer] = torch.empty_strided(shape, stride, dtype=dtype)
                pointers[buffer] = value.data_ptr()
            for run, source, destination in recording.calls:
                run(pointers[source], pointers[destination])
        finally:
            if keep:
                pool.append((block, addresses))
        for slot, buffer in recording.outputs:
            env[slot] = tensors[buffer]

    def _new_block(self, recording: _Recording) -> tuple[torch.Tensor, list[int], bool]:
        """A new buffer for ``recording``, and whether it is kept (to the pool after its call): while the run's kept
        buffers stay within ``KEPT_LIMIT``; otherwise it is freed after its call."""
        block, addresses = _block(recording)
        with self.lock:
            keep = self.kept + block.numel() <= KEPT_LIMIT
            if keep:
                self.kept += block.numel()
        return block, addresses, keep

    def _buffers(self, buffer_of: dict[int, int], made: dict[int, tuple[int, Any]]) -> dict[int, _Buffer]:
        """Lifetimes of the buffers the run makes: from the step making one to the last step reading any value in
        it (a sum writes a new value into its accumulator's buffer), or escaping if a value in it is read later."""
        last = {b: position for b, (position, _) in made.items()}
        escapes: set[int] = set()
        for position, slots in enumerate(self.reads):
            for slot in slots:
                last[buffer_of[slot]] = max(last.get(buffer_of[slot], -1), position)
        for slot in self.escaping:
            escapes.add(buffer_of[slot])
        return {b: _Buffer(position, last[b], tensor.untyped_storage().nbytes(), b in escapes)
                for b, (position, tensor) in made.items()}


def _generations(modules: list[nn.Module]) -> list[int]:
    return [module.generation for module in modules]  # type: ignore[misc]  # every member is a _BackendModule


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


def _block(recording: _Recording) -> tuple[torch.Tensor, list[int]]:
    block = torch.empty(max(recording.arena_bytes, 1), dtype=torch.uint8)
    addresses = [0] * recording.buffers
    for buffer, offset in recording.arena:
        addresses[buffer] = block.data_ptr() + offset
    return block, addresses


def _walk(steps: Sequence[Step], env: list[Any], gm: nn.Module, plain: bool) -> None:
    """``steps`` as the runner walks them (a run among them replays on its own)."""
    for step in steps:
        if step.op == "run":
            step.target(env, gm, plain)
        else:
            env[step.slot] = execute(step, env, gm, plain)
        for dead in step.freed:
            env[dead] = None


def group(steps: list[Step], gm: nn.Module, last_read: dict[int, int], *, extras: bool = True) -> list[Step]:
    """``steps`` with every stretch that makes two or more calls on the onednn backend replaced by one ``Run`` step:
    layers, and with ``extras`` the other recorded steps and views in between (see the module docstring);
    ``last_read``: per slot, the position of the last step reading it (past the end for the graph's output)."""
    grouped: list[Step] = []
    stretch: list[Step] = []
    calls = 0

    def close(end: int) -> None:
        tail: list[Step] = []
        while stretch and stretch[-1].op != "call_module":  # views at the end stay outside: nothing to gain
            tail.insert(0, stretch.pop())
        end -= len(tail)
        if calls < 2:
            grouped.extend(stretch)
        else:
            produced = {step.slot for step in stretch}
            escaping = frozenset(slot for slot in produced if last_read.get(slot, -1) >= end)
            freed = tuple(slot for step in stretch for slot in step.freed if slot not in produced)
            grouped.append(Step(-1, "run", Run(stretch, escaping, gm), None, (), {}, freed))
        grouped.extend(tail)
        stretch.clear()

    for position, step in enumerate(steps):
        kind = _kind(step, gm, extras)
        if kind is not None and (kind != "view" or stretch):
            stretch.append(step)
            calls += kind != "view"
        else:
            close(position)
            calls = 0
            grouped.append(step)
    close(len(steps))
    return grouped

"""fxquant's own oneDNN primitives (``fxquant/kernels/onednn/csrc/`` through ``fxquant.kernels.onednn.direct``)
against the torch
ops they replace: the same integers out for every geometry the onednn backend runs, fused post-ops, float outputs,
the conv+add sum, and what happens around them (threads, a full cache, a refused primitive, the off switch).

The contract tests (test_backend_contract.py, test_fused_kernels.py) hold both paths to the reference backend too.
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch
from kernel_contract_cases import ConvCase, conv_layer, float_conv, make_layer, output_qparams

from fxquant.kernels.base import ConvAddQParams, ConvSpec, PackedWeight
from fxquant.kernels.onednn import direct as onednn_direct
from fxquant.kernels.registry import get_backend
from fxquant.qparams import QParams
from fxquant.report.sections import Environment

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                                reason="Intel's oneDNN wheel is for x86-64 Linux")

CONVS = [  # (spec, in channels, out channels, kernel, input size, batch)
    (ConvSpec(2, (1, 1), (0, 0), (1, 1), 1), 16, 24, (1, 1), (7, 7), 1),
    (ConvSpec(2, (1, 1), (1, 1), (1, 1), 1), 8, 16, (3, 3), (9, 11), 2),
    (ConvSpec(2, (2, 2), (1, 1), (1, 1), 1), 5, 7, (3, 3), (12, 9), 3),
    (ConvSpec(2, (1, 1), (2, 2), (2, 2), 1), 8, 8, (3, 3), (10, 10), 1),
    (ConvSpec(2, (1, 1), (1, 1), (1, 1), 4), 8, 12, (3, 3), (6, 6), 2),
    (ConvSpec(2, (2, 2), (1, 1), (1, 1), 16), 16, 16, (3, 3), (14, 14), 1),  # depthwise
    (ConvSpec(2, (1, 1), (0, 2), (1, 1), 1), 3, 5, (1, 5), (4, 17), 1),
    (ConvSpec(1, (2,), (2,), (1,), 1), 6, 10, (5,), (40,), 2),
    (ConvSpec(3, (1, 1, 1), (1, 1, 1), (1, 1, 1), 1), 4, 6, (3, 3, 3), (5, 6, 7), 1),
]
OUTPUTS = ["uint8", "uint8+relu", "uint8+silu", "float"]
CONV_OUTPUTS = [(*conv, output) for conv in CONVS for output in OUTPUTS
                if not (conv[0].dim == 3 and output == "uint8+silu")]  # conv3d: no fused unary on either path


def _both_paths(monkeypatch: pytest.MonkeyPatch,
                pack: Callable[[], PackedWeight]) -> tuple[PackedWeight, PackedWeight]:
    """The same weight packed for fxquant's primitives and, with the library hidden, for the torch ops."""
    assert onednn_direct.available(), onednn_direct.status()
    direct = pack()
    with monkeypatch.context() as patch:
        patch.setattr(onednn_direct, "available", lambda: False)
        ops = pack()
    assert direct.payload.plain is not None or direct.payload.holds_weight()  # a conv's plain weight, a Linear's held
    assert ops.payload.plain is None and not ops.payload.holds_weight()
    return direct, ops


@pytest.mark.parametrize(("spec", "cin", "cout", "kernel", "size", "batch", "output"), CONV_OUTPUTS)
def test_direct_conv_gives_the_torch_ops_integers(monkeypatch: pytest.MonkeyPatch, spec: ConvSpec, cin: int,
                                                  cout: int, kernel: tuple[int, ...], size: tuple[int, ...],
                                                  batch: int, output: str) -> None:
    """uint8 results (with ReLU or not) are the op's bit for bit; SiLU (oneDNN 3.2 here, torch's own oneDNN there)
    within one step; float results to float32 rounding."""
    onednn = get_backend("onednn")
    layer = conv_layer(ConvCase(spec, batch, cin, cout, kernel, size, True, True, False), (0, 255), 3)
    out_qp = output_qparams(float_conv(layer, spec))
    direct, ops = _both_paths(monkeypatch, lambda: onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec,
                                                                       in_qp=layer.in_qp))

    def run(packed: PackedWeight) -> torch.Tensor:
        if output == "float":
            return onednn.conv_to_float(layer.q_x, packed, layer.in_qp, out_qp, relu=False)
        if output == "uint8+silu":
            return onednn.conv_unary(layer.q_x, packed, layer.in_qp, out_qp, "silu", out_qp)
        return onednn.conv(layer.q_x, packed, layer.in_qp, out_qp, relu=output == "uint8+relu")

    mine, theirs = run(direct), run(ops)
    assert len(direct.payload.calls) == 1
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    if output == "float":
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-4)
    elif output == "uint8+silu":
        assert int((mine.int() - theirs.int()).abs().max()) <= 1
    else:
        assert torch.equal(mine, theirs), f"{int((mine.int() - theirs.int()).abs().max())} steps apart"


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 7)])
@pytest.mark.parametrize(("per_channel", "bias", "relu"), [(True, True, False), (False, False, True),
                                                           (True, False, True)])
def test_direct_linear_gives_the_torch_ops_integers(monkeypatch: pytest.MonkeyPatch, lead: tuple[int, ...],
                                                    per_channel: bool, bias: bool, relu: bool) -> None:
    """A Linear runs as oneDNN's matmul (its inner product takes no zero points), on any leading dims; the input zero
    point folded into the bias and not."""
    onednn = get_backend("onednn")
    layer = make_layer((*lead, 33), (17, 33), qrange=(0, 255), per_channel=per_channel, bias=bias, seed=5)
    out_qp = QParams(torch.tensor(0.37), torch.tensor(11), 0, 255)
    for in_qp in (layer.in_qp, None):  # packed for the input's qparams (folded) or for any
        direct, ops = _both_paths(monkeypatch, lambda qp=in_qp: onednn.prepack_linear(layer.q_w, layer.w_qp,
                                                                                       layer.bias, in_qp=qp))
        mine = onednn.linear(layer.q_x, direct, layer.in_qp, out_qp, relu=relu)
        theirs = onednn.linear(layer.q_x, ops, layer.in_qp, out_qp, relu=relu)
        assert mine.shape == (*lead, 17)
        assert torch.equal(mine, theirs)
        floats = [onednn.linear_to_float(layer.q_x, p, layer.in_qp, out_qp, relu=relu) for p in (direct, ops)]
        torch.testing.assert_close(floats[0], floats[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("relu", [False, True])
def test_direct_conv_add_gives_the_torch_ops_integers(monkeypatch: pytest.MonkeyPatch, relu: bool) -> None:
    """The sum post-op reads the accumulator from the destination: both paths write the result into ``accum`` (the
    graph copies an accumulator read later), the direct one without the op's extra copy of the result."""
    onednn = get_backend("onednn")
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 2, 8, 8, (3, 3), (6, 6), True, True, False), (0, 255), 9)
    gen = torch.Generator().manual_seed(2)
    accum = torch.randint(0, 256, (2, 8, 6, 6), generator=gen, dtype=torch.uint8)
    accum = accum.contiguous(memory_format=torch.channels_last)
    qps = ConvAddQParams(layer.in_qp, output_qparams(float_conv(layer, spec)),
                         QParams(torch.tensor(0.05), torch.tensor(100), 0, 255),
                         QParams(torch.tensor(0.09), torch.tensor(60), 0, 255))
    direct, ops = _both_paths(monkeypatch, lambda: onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec,
                                                                       in_qp=layer.in_qp))
    accums = [accum.clone(memory_format=torch.channels_last) for _ in range(2)]
    mine = onednn.conv_add(layer.q_x, direct, accums[0], qps, relu=relu)
    theirs = onednn.conv_add(layer.q_x, ops, accums[1], qps, relu=relu)
    assert torch.equal(mine, theirs) and torch.equal(accums[0], accums[1])
    assert mine.data_ptr() == accums[0].data_ptr()
    assert not torch.equal(mine, accum)


@pytest.mark.parametrize("kind", ["linear", "linear+relu", "conv+relu", "conv_add"])
def test_a_7_bit_output_is_clipped_in_the_primitive_to_the_ops_clamped_bytes(monkeypatch: pytest.MonkeyPatch,
                                                                              kind: str) -> None:
    """Where activations are 7-bit (oneDNN without VNNI), fxquant's primitive clips with a post-op while the torch op
    is clamped after it: the same bytes, and the bound call is the primitive's own (nothing after it)."""
    onednn, spec = get_backend("onednn"), ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    narrow = QParams(torch.tensor(0.02), torch.tensor(60), 0, 127)  # many results above 127 and below 0
    if kind.startswith("linear"):
        layer = make_layer((6, 33), (17, 33), qrange=(0, 255), per_channel=True, bias=True, seed=5)
        direct, ops = _both_paths(monkeypatch, lambda: onednn.prepack_linear(layer.q_w, layer.w_qp, layer.bias))
        wide_qp = QParams(narrow.scale, narrow.zero_point, 0, 255)
        mine, theirs, wide = (onednn.linear(layer.q_x, p, layer.in_qp, qp, relu=kind.endswith("relu"))
                              for p, qp in ((direct, narrow), (ops, narrow), (direct, wide_qp)))
    else:
        layer = conv_layer(ConvCase(spec, 2, 8, 8, (3, 3), (6, 6), True, True, False), (0, 255), 9)
        direct, ops = _both_paths(monkeypatch, lambda: onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec,
                                                                           in_qp=layer.in_qp))
        accum = torch.randint(0, 128, (2, 8, 6, 6), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
        accum_qp = QParams(torch.tensor(0.01), torch.tensor(30), 0, 127)

        def run(packed: PackedWeight, out_qp: QParams) -> torch.Tensor:
            if kind == "conv+relu":
                return onednn.conv(layer.q_x, packed, layer.in_qp, out_qp, relu=True)
            qps = ConvAddQParams(layer.in_qp, out_qp, accum_qp, out_qp)
            return onednn.conv_add(layer.q_x, packed, accum.contiguous(memory_format=torch.channels_last).clone(
                memory_format=torch.channels_last), qps, relu=False)

        mine, theirs = run(direct, narrow), run(ops, narrow)
        wide = run(direct, QParams(narrow.scale, narrow.zero_point, 0, 255))
    assert int(wide.max()) > 127 and int(mine.max()) == 127, "the clip must have had something to do"
    assert torch.equal(mine, theirs) and torch.equal(mine, wide.clamp(0, 127))
    assert all(hasattr(call, "primitive") for call in direct.payload.calls.values())


def _conv_setup() -> tuple[ConvSpec, object, QParams]:
    spec = ConvSpec(2, (1, 1), (1, 1), (1, 1), 1)
    layer = conv_layer(ConvCase(spec, 2, 8, 16, (3, 3), (20, 20), True, True, False), (0, 255), 4)
    return spec, layer, output_qparams(float_conv(layer, spec))


def test_calls_from_two_threads_at_once_get_their_own_memories() -> None:
    """The GIL is released while oneDNN runs, so two threads can be inside one primitive: the second call runs with
    its own memories and scratchpad and both get the right result."""
    onednn = get_backend("onednn")
    spec, layer, out_qp = _conv_setup()
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    expected = onednn.conv(layer.q_x, packed, layer.in_qp, out_qp, relu=False)
    inputs = [layer.q_x.roll(shifts, dims=3) for shifts in range(4)]
    wanted = [onednn.conv(x, packed, layer.in_qp, out_qp, relu=False) for x in inputs]
    failures: list[str] = []

    def worker(index: int) -> None:
        for _ in range(150):
            if not torch.equal(onednn.conv(inputs[index], packed, layer.in_qp, out_qp, relu=False), wanted[index]):
                failures.append(f"thread {index}")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert torch.equal(wanted[0], expected)


def test_a_full_cache_runs_the_torch_op_with_the_same_results() -> None:
    """Past 16 bound calls per weight a new input shape binds the torch op each time instead of building (and
    dropping) a primitive per call; the results do not change."""
    onednn = get_backend("onednn")
    spec, layer, out_qp = _conv_setup()
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    fresh = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    for width in range(5, 25):
        x = layer.q_x[..., :width]
        out = onednn.conv(x, packed, layer.in_qp, out_qp, relu=False)
        fresh.payload.calls.clear()
        assert torch.equal(out, onednn.conv(x, fresh, layer.in_qp, out_qp, relu=False)), width
    assert len(packed.payload.calls) == 16


def test_a_layers_primitives_share_its_reordered_weights_where_the_layout_matches() -> None:
    """Batch 1, 2 and 3 of one layer: one copy of the reordered weights where oneDNN picks one layout (each shape's
    result still that of a freshly packed weight), and a deep copy shares them too."""
    onednn = get_backend("onednn")
    spec, layer, out_qp = _conv_setup()
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    inputs = [torch.cat([layer.q_x] * 2)[:batch] for batch in (1, 2, 3)]
    outputs = [onednn.conv(x, packed, layer.in_qp, out_qp, relu=True) for x in inputs]
    for x, out in zip(inputs, outputs, strict=True):
        fresh = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
        assert torch.equal(out, onednn.conv(x, fresh, layer.in_qp, out_qp, relu=True))
    primitives = [call.primitive for call in packed.payload.calls.values()]
    assert len(primitives) == 3 and packed.payload.shared == primitives[:1]
    assert len({p.weights_address for p in primitives}) == 1  # this 8 -> 16 3x3 conv: one layout for all three
    copied = copy.deepcopy(packed)
    del packed, primitives
    out = onednn.conv(inputs[0], copied, layer.in_qp, out_qp, relu=True)
    assert torch.equal(out, outputs[0])
    assert next(iter(copied.payload.calls.values())).primitive.weights_address == copied.payload.shared[0]. \
        weights_address


def test_a_primitive_onednn_refuses_runs_on_the_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A oneDNN without an implementation (status ``unimplemented``) makes the layer call the torch op."""
    onednn = get_backend("onednn")
    spec, layer, out_qp = _conv_setup()
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    expected = onednn.conv(layer.q_x, packed, layer.in_qp, out_qp, relu=False)
    packed.payload.calls.clear()

    def refuse(*args: object) -> None:
        raise RuntimeError("oneDNN convolution descriptor failed (status 3)")

    assert onednn_direct._dnnl is not None
    monkeypatch.setattr(onednn_direct._dnnl, "Primitive", refuse)
    assert torch.equal(onednn.conv(layer.q_x, packed, layer.in_qp, out_qp, relu=False), expected)


def test_a_non_uint8_activation_is_refused() -> None:
    """The primitive reads raw bytes: an int8 or float tensor gets a TypeError, not a misread."""
    onednn = get_backend("onednn")
    spec, layer, out_qp = _conv_setup()
    packed = onednn.prepack_conv(layer.q_w, layer.w_qp, layer.bias, spec, in_qp=layer.in_qp)
    with pytest.raises(TypeError, match="uint8 activations"):
        onednn.conv(layer.q_x.to(torch.int8), packed, layer.in_qp, out_qp, relu=False)


def test_one_openmp_runtime_serves_torch_and_onednn() -> None:
    """oneDNN's libgomp.so.1 resolves to torch's: one thread pool, so torch.set_num_threads governs both. (In a
    fresh process: other packages bring their own, e.g. scikit-learn's bundled libgomp.)"""
    code = ("from fxquant.kernels.onednn import direct as d; print(d.available()); "
            "print(*sorted(d._gomp_runtimes()), sep='\\n')")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert lines[0] == "True"
    assert len(lines[1:]) == 1 and "torch" in lines[1], lines[1:]


@pytest.mark.parametrize(("value", "expected"), [("0", "off: FXQUANT_DNNL_LIBRARY=0"),
                                                  ("/nonexistent/libdnnl.so.3", "off: cannot load /nonexistent")])
def test_the_library_can_be_turned_off_or_pointed_elsewhere(value: str, expected: str) -> None:
    """``FXQUANT_DNNL_LIBRARY``: 0 turns the direct path off, a path loads that library; either way the backend runs
    (on the torch ops) and the report's environment says why."""
    code = ("import torch; from fxquant.kernels.onednn import direct as d; from fxquant.kernels.registry import "
            "get_backend; b = get_backend('onednn'); w = torch.randint(-9, 9, (4, 8), dtype=torch.int8); "
            "from fxquant.qparams import QParams; qp = QParams(torch.tensor(0.1), torch.tensor(3), 0, 255); "
            "p = b.prepack_linear(w, QParams(torch.tensor(0.02), torch.tensor(0), -128, 127), None); "
            "y = b.linear(torch.full((2, 8), 7, dtype=torch.uint8), p, qp, qp, relu=False); "
            "print(d.status()); print(p.payload.plain is None, tuple(y.shape))")
    env = {**os.environ, onednn_direct.LIBRARY_ENV: value}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    status, ran = result.stdout.strip().splitlines()
    assert status.startswith(expected), status
    assert ran == "True (2, 4)"


def test_the_report_environment_records_the_onednn_it_called() -> None:
    env = Environment(torch="2.13.0", onednn=onednn_direct.status())
    assert env.onednn.startswith("oneDNN 3.")
    assert Environment.from_dict(env.to_dict()) == env
    assert Environment.from_dict({"torch": "2.13.0"}).onednn == ""  # reports written before the field


@pytest.mark.parametrize(("bias", "scales", "strides", "message"), [
    (b"\0" * 12, b"\0\0\x80?", [8, 1], "one float32 per output channel"),
    (None, b"\0" * 8, [8, 1], "one float32 per output channel"),
    (None, b"\0\0\x80?", [1], "dims and strides do not match"),
])
def test_malformed_primitive_arguments_raise_instead_of_reading_past_a_buffer(
        bias: bytes | None, scales: bytes, strides: list[int], message: str) -> None:
    assert onednn_direct.available() and onednn_direct._dnnl is not None, onednn_direct.status()
    weight = torch.ones(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=message):
        onednn_direct._dnnl.Primitive(weight.data_ptr(), [4, 8], [2, 8], strides, [2, 4], [4, 1], "u8", scales, bias,
                                      0.1, 0, 0.1, 0, None, (), None)

"""Element-wise activations between int8 ops as 256-entry tables (``fxquant.nn.lookup``, ``fuse_lookup``).

Checked against the unfused ops the table replaces (the backend's dequantize, the float function, its quantize) and
against float64 arithmetic by hand; on every backend, with and without the C loop, in every layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxquant
from fxquant import native
from fxquant.kernels.base import Backend
from fxquant.kernels.registry import available_backends, get_backend
from fxquant.nn.lookup import QuantizedLookup
from fxquant.nn.quantized import DeQuantize, Quantize
from fxquant.qparams import QParams
from fxquant.testing import simulate

pytestmark = pytest.mark.usefixtures("native_loops")

BACKENDS = [name for name in ("fbgemm", "qnnpack", "onednn", "reference") if name in available_backends()]
FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "hardswish": F.hardswish, "gelu": F.gelu, "mish": F.mish,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "elu": functools.partial(F.elu, alpha=0.5),
    "leaky_relu": functools.partial(F.leaky_relu, negative_slope=0.2)}


def _qp(scale: float, zero_point: int, qmax: int = 255) -> QParams:
    return QParams(torch.tensor(scale), torch.tensor(zero_point), 0, qmax)


def _int8_value(backend: Backend, shape: tuple[int, ...], qp: QParams, layout: str) -> torch.Tensor:
    stored = torch.randint(0, qp.qmax + 1, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    if layout == "channels_last":
        stored = stored.contiguous(memory_format=torch.channels_last if stored.dim() == 4 else torch.channels_last_3d)
    value = backend.from_bytes(stored, qp)
    return value.transpose(-1, -2) if layout == "transposed" else value


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_the_table_gives_the_unfused_ops_and_float64_by_hand(name: str, function: str) -> None:
    backend, f = get_backend(name), FUNCTIONS[function]
    qa, qout = _qp(0.05, 140), _qp(0.03, 30)
    a = _int8_value(backend, (2, 24, 9, 11), qa, "contiguous")
    out = backend.to_bytes(QuantizedLookup(f, qa, qout, backend)(a)).int()
    unfused = backend.to_bytes(backend.quantize(f(backend.dequantize(a, qa)), qout)).int()
    steps = (out - unfused).abs()
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.01, f"{name}/{function}: {steps.max()}"
    levels = (backend.to_bytes(a).double() - 140) * 0.05
    by_hand = torch.clamp(torch.round(f(levels) / 0.03) + 30, 0, 255)
    assert int((out - by_hand).abs().max()) <= 1


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("shape", "layout"), [((3, 130), "contiguous"), ((2, 6, 5, 7), "channels_last"),
                                               ((2, 6, 3, 5, 7), "channels_last"), ((2, 6, 5, 7), "transposed"),
                                               ((1, 64 * 3 + 5), "contiguous")])
def test_every_layout_keeps_its_shape_qparams_and_values(name: str, shape: tuple[int, ...], layout: str) -> None:
    backend = get_backend(name)
    qa, qout = _qp(0.1, 120, qmax=127), _qp(0.02, 12)
    a = _int8_value(backend, shape, qa, layout)
    lookup = QuantizedLookup(nn.SiLU(), qa, qout, backend)
    out = lookup(a)
    assert out.shape == a.shape
    expected = lookup.table[backend.to_bytes(a).long()]  # the table, indexed in torch
    assert torch.equal(backend.to_bytes(out), expected)
    assert torch.equal(backend.to_bytes(backend.quantize(backend.dequantize(out, qout), qout)), expected)
    if layout == "channels_last" and native.loops is not None:
        assert native.dense_format(out) == native.dense_format(a)  # the next conv reads it without a copy


def test_the_c_loop_covers_every_byte_and_a_ragged_tail() -> None:
    from fxquant.native import _native  # the loop itself, whichever path the fixture selects for the modules

    table = torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    for n in (1, 63, 64, 65, 256 * 3 + 17):
        a = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
        out = torch.empty_like(a)
        _native.lookup_u8(a.data_ptr(), out.data_ptr(), n, table.data_ptr())
        assert torch.equal(out, table[a.long()]), n


class _Block(nn.Module):
    """Activations in the forms users write: a module shared by two call sites, functional ones with options, one
    after a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c3, self.c4, self.c5 = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.c6 = nn.Conv2d(8, 8, 1)
        self.act = nn.SiLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.c1(x))
        y = F.gelu(self.c2(y), approximate="tanh")
        y = self.c4(self.act(self.c3(y)))
        y = self.c6(F.leaky_relu(self.c5(y) + y, 0.2))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def _converted(backend: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    torch.manual_seed(0)
    prepared = fxquant.prepare(_Block().eval(), (torch.randn(2, 3, 8, 8),))
    fxquant.calibrate(prepared, [torch.randn(4, 3, 8, 8) for _ in range(3)], progress=False)
    return prepared, fxquant.convert(prepared, backend=backend)


def _lookups(gm: fx.GraphModule) -> list[QuantizedLookup]:
    return [m for m in gm.modules() if isinstance(m, QuantizedLookup)]


@pytest.mark.parametrize("name", BACKENDS)
def test_convert_fuses_each_dequantize_activation_quantize_and_stays_within_a_step(name: str) -> None:
    prepared, qmodel = _converted(name)
    lookups = _lookups(qmodel)
    # fbgemm/qnnpack: both calls of the shared SiLU (two tables), the GELU and the leaky ReLU after the add become
    # tables. Backends whose convs return float results (onednn, reference) keep those before an activation (one
    # rounding fewer); the leaky ReLU after the add (an int8 conv + add) still becomes a table.
    float_convs = get_backend(name).fuses_float_conv_output
    assert len(lookups) == (1 if float_convs else 4), (name, [m.extra_repr() for m in lookups])
    if not float_convs:
        silu = [m for m in lookups if isinstance(m.function, nn.SiLU)]
        assert len(silu) == 2 and not torch.equal(silu[0].table, silu[1].table)
    x = torch.randn(5, 3, 8, 8)
    step = float(qmodel.get_submodule("fc").out_qp.scale)
    with torch.no_grad():
        error = float((qmodel(x) - simulate(prepared, name)(x)).abs().max()) / step
    assert error <= 3.0, f"{name}: {error:.2f} output steps from the simulation"
    kinds = [type(qmodel.get_submodule(str(n.target))) for n in qmodel.graph.nodes if n.op == "call_module"]
    assert kinds.count(DeQuantize) <= 1  # at most the output's: no activation reads a dequantized int8 value
    if not float_convs:
        assert kinds.count(Quantize) == 1  # the input's: int8 from there to the end


def test_an_activation_whose_input_is_read_twice_in_float_is_left_alone() -> None:
    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 1), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            z = F.silu(y) + torch.exp(y)  # the dequantized conv output is read by SiLU and by exp
            return self.fc(z.mean((2, 3)))

    prepared = fxquant.prepare(TwoReaders().eval(), (torch.randn(1, 3, 4, 4),))
    fxquant.calibrate(prepared, [torch.randn(2, 3, 4, 4)], progress=False)
    assert not _lookups(fxquant.convert(prepared, backend="reference"))


def test_relowering_rebuilds_the_table_for_the_new_backend() -> None:
    if not {"fbgemm", "qnnpack"} <= set(BACKENDS):
        pytest.skip("needs fbgemm and qnnpack")
    qa, qout = _qp(0.05, 140, qmax=127), _qp(0.03, 30, qmax=127)
    lookup = QuantizedLookup(F.silu, qa, qout, get_backend("fbgemm"))
    before = lookup.table
    lookup.relower(get_backend("qnnpack"))
    assert lookup.backend.name == "qnnpack" and lookup.table is not before
    assert torch.equal(lookup.table, get_backend("qnnpack").lookup_table(F.silu, qa, qout))


def test_an_exported_model_computes_the_same_tables(tmp_path: Path) -> None:
    if "fbgemm" not in BACKENDS:
        pytest.skip("export needs fbgemm")
    _, qmodel = _converted("fbgemm")
    assert _lookups(qmodel)
    x = torch.randn(3, 3, 8, 8)
    path = fxquant.export(qmodel, tmp_path / "model.pt")
    assert torch.equal(torch.jit.load(str(path))(x), qmodel(x))


def test_a_saved_model_with_tables_loads_to_the_same_outputs(tmp_path: Path) -> None:
    name = BACKENDS[0]
    torch.manual_seed(0)
    model = _Block().eval()
    prepared = fxquant.prepare(model, (torch.randn(2, 3, 8, 8),))
    fxquant.calibrate(prepared, [torch.randn(4, 3, 8, 8) for _ in range(3)], progress=False)
    qmodel = fxquant.convert(prepared, backend=name)
    loaded = fxquant.load(fxquant.save(qmodel, tmp_path / "artifact"), model)
    assert len(_lookups(loaded)) == len(_lookups(qmodel)) > 0
    x = torch.randn(3, 3, 8, 8)
    assert torch.equal(loaded(x), qmodel(x))


@pytest.mark.parametrize("name", BACKENDS)
def test_a_float_input_is_refused_not_misread(name: str) -> None:
    lookup = QuantizedLookup(F.silu, _qp(0.05, 140), _qp(0.03, 30), get_backend(name))
    with pytest.raises(TypeError, match="int8 lookup"):
        lookup(torch.randn(2, 8))

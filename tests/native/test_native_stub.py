"""The stub ``fxquant/native/_native.pyi`` against the C entry points it describes (``fxquant/native/csrc/module.c``).

mypy checks every call into the extension against the stub, so the stub must say what the C side parses: for each
function in the method table, its parameters tuple by tuple and unit by unit as its ``PyArg_ParseTuple`` format
string reads them (``K``/``L``/``n``/``i`` an int, ``d`` a float, ``p`` a bool, ``(...)`` a tuple: one C struct),
all positional-only (``METH_VARARGS`` takes no keywords), and what it returns. Read from the sources: no build needed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "fxquant" / "native"
MODULE_C = NATIVE / "csrc" / "module.c"
ENTRY_SOURCES = (MODULE_C, NATIVE / "csrc" / "module_rows.c")  # module.c's method table lists both files' functions
STUB = NATIVE / "_native.pyi"

Shape = str | tuple["Shape", ...]  # a leaf type name ("int", "float", "bool", "None") or a tuple of shapes
_UNITS = {"K": "int", "L": "int", "n": "int", "i": "int", "d": "float", "f": "float", "p": "bool"}
_BUILT = {**_UNITS, "O": "*"}  # Py_BuildValue's units; "O" (an object: Py_True, ...) matches any type


@dataclass(frozen=True)
class EntryPoint:
    """What the C side of one function parses and returns."""

    params: tuple[Shape, ...]
    returns: frozenset[Shape]  # "None" (Py_RETURN_NONE), "bool" (Py_RETURN_TRUE/FALSE), a Py_BuildValue tuple


def parse_format(fmt: str, units: dict[str, str] = _UNITS) -> tuple[Shape, ...]:
    """A ``PyArg_ParseTuple`` format string as nested shapes: ``"K(LL)d"`` -> ``("int", ("int", "int"), "float")``."""
    stack: list[list[Shape]] = [[]]
    for unit in fmt:
        if unit == "(":
            stack.append([])
        elif unit == ")":
            group = tuple(stack.pop())
            stack[-1].append(group)
        elif unit in ":;":  # the function name or error message that may end a format
            break
        else:
            assert unit in units, f"format unit {unit!r} in {fmt!r}: add its Python type to _UNITS"
            stack[-1].append(units[unit])
    assert len(stack) == 1, f"unbalanced parentheses in {fmt!r}"
    return tuple(stack[0])


def c_entry_points(source: str) -> dict[str, EntryPoint]:
    """Every ``METH_VARARGS`` function of the method table, by its Python name."""
    table = dict(re.findall(r'\{"(\w+)",\s*(\w+),\s*METH_VARARGS', source))
    assert table, "no METH_VARARGS entry in the method table"
    entries = {}
    for name, function in table.items():
        body = re.search(rf"(?:static )?PyObject \*{function}\(PyObject \*self, PyObject \*args\) \{{(.*?)\n\}}\n",
                         source, re.S)
        assert body is not None, f"{name}: no definition of {function} in module.c or module_rows.c"
        formats = re.findall(r'PyArg_ParseTuple\(args,\s*((?:"[^"]*"\s*)+),', body.group(1))
        assert len(formats) == 1, f"{name}: expected one PyArg_ParseTuple(args, \"...\", ...), found {len(formats)}"
        fmt = "".join(re.findall(r'"([^"]*)"', formats[0]))
        returns: set[Shape] = set()
        if "Py_RETURN_NONE" in body.group(1):
            returns.add("None")
        if "Py_RETURN_TRUE" in body.group(1) or "Py_RETURN_FALSE" in body.group(1):
            returns.add("bool")
        for built in re.findall(r'Py_BuildValue\("([^"]*)"', body.group(1)):
            returns.add(parse_format(built, _BUILT))
        entries[name] = EntryPoint(parse_format(fmt), frozenset(returns))
    return entries


def _shape(node: ast.expr, aliases: dict[str, ast.expr]) -> Shape:
    if isinstance(node, ast.Name):
        return _shape(aliases[node.id], aliases) if node.id in aliases else node.id
    if isinstance(node, ast.Constant) and node.value is None:
        return "None"
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "tuple":
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return tuple(_shape(item, aliases) for item in items)
    raise AssertionError(f"the stub's annotation {ast.unparse(node)!r} is not int, float, bool, None or a tuple")


def stub_functions(text: str) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}


def stub_aliases(text: str) -> dict[str, ast.expr]:
    return {target.id: node.value for node in ast.parse(text).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def mismatches(entries: dict[str, EntryPoint], stub_text: str) -> list[str]:
    """Every way the stub disagrees with the C entry points, as readable lines (empty: they agree)."""
    functions, aliases = stub_functions(stub_text), stub_aliases(stub_text)
    problems = [f"{name}: in module.c's method table, not in the stub" for name in sorted(entries.keys() - functions)]
    problems += [f"{name}: in the stub, not in module.c" for name in sorted(functions.keys() - entries.keys())]
    for name in sorted(entries.keys() & functions.keys()):
        entry, args = entries[name], functions[name].args
        if args.args or args.kwonlyargs or args.vararg or args.kwarg:
            problems.append(f"{name}: every parameter must be positional-only (end them with '/')")
        params = [arg.annotation for arg in args.posonlyargs + args.args]
        if any(annotation is None for annotation in params):
            problems.append(f"{name}: a parameter without annotation")
            continue
        stub_params = tuple(_shape(annotation, aliases) for annotation in params if annotation is not None)
        if stub_params != entry.params:
            problems.append(f"{name}: the stub takes {stub_params}, the C format parses {entry.params}")
        returns = functions[name].returns
        stub_return = "None" if returns is None else _shape(returns, aliases)
        if not entry.returns or not all(_matches(stub_return, c_return) for c_return in entry.returns):
            problems.append(f"{name}: the stub returns {stub_return}, the C function returns {set(entry.returns)}")
    return problems


def _matches(stub: Shape, c: Shape) -> bool:
    if c == "*":
        return True
    if isinstance(stub, tuple) and isinstance(c, tuple):
        return len(stub) == len(c) and all(_matches(s, t) for s, t in zip(stub, c, strict=True))
    return stub == c


ENTRIES = c_entry_points("\n".join(path.read_text() for path in ENTRY_SOURCES))


def test_the_stub_says_what_the_c_entry_points_parse() -> None:
    problems = mismatches(ENTRIES, STUB.read_text())
    assert not problems, "fxquant/native/_native.pyi disagrees with csrc/module.c:\n" + "\n".join(problems)


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("counts_ptr: int, /) -> tuple[float, float, bool]", "/) -> tuple[float, float, bool]", "scan_f32: the stub"),
    ("_Requant = tuple[int, int, bool, int]", "_Requant = tuple[int, int, int, int]", "conv_u8: the stub"),
    ("_PatchRequant = tuple[float, float, int, int]", "_PatchRequant = tuple[float, float, int]", "patches_u8"),
    ("def lookup_u8(src_ptr: int, dst_ptr: int, n: int, table_ptr: int, /)",
     "def lookup_u8(src_ptr: int, dst_ptr: int, n: int, table_ptr: int)", "positional-only"),
    ("def set_isa_cap(level: int, /) -> None: ...", "", "set_isa_cap: in module.c's method table"),
    ("-> bool: ...\ndef conv_u8", "-> None: ...\ndef conv_u8", "linear_rows_u8: the stub returns"),
    ("-> tuple[float, float, bool]", "-> tuple[float, bool]", "scan_f32: the stub returns"),
])
def test_a_stub_that_drifts_fails(old: str, new: str, expected: str) -> None:
    """The check itself: a parameter dropped, a struct's field typed or counted wrong, keywords allowed, an entry
    point left out or a return type changed is each reported."""
    text = STUB.read_text()
    assert old in text, f"the mutation's anchor {old!r} is gone from the stub: update this test"
    problems = mismatches(ENTRIES, text.replace(old, new))
    assert any(expected in problem for problem in problems), problems


def test_format_strings_read_as_nested_tuples() -> None:
    assert parse_format("K(LL)(d(pn))i") == ("int", ("int", "int"), ("float", ("bool", "int")), "int")
    assert parse_format("KL:scan") == ("int", "int")


def test_only_module_c_parses_arguments() -> None:
    """The kernel files compute on checked structs: no Python API, so none of them can parse (or drift); only the
    entry-point files (module.c and the part of it kept apart for size) do."""
    for path in sorted((NATIVE / "csrc").glob("*.c")):
        if path not in ENTRY_SOURCES:
            text = path.read_text()
            assert "Python.h" not in text and "PyArg_" not in text, f"{path.name} uses the Python API"

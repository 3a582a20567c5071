"""The package's shape, enforced: the import-layer rule of docs/architecture.md, no import cycles, a line budget per
file, and an ``import fxquant`` that pulls in no optional dependency.

Every ``import`` statement is parsed, the ones inside functions (lazy imports) included; only imports under
``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import fxquant

PACKAGE = Path(fxquant.__file__).parent
ROOT = PACKAGE.parent

# Bottom to top (docs/architecture.md "The layer rule"). A module imports only its own unit and units of strictly
# lower layers. A unit is a top-level module or subpackage of fxquant.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer.split()) for layer in (
    "errors _version",
    "qparams serialization tracing native models",
    "observers kernels",
    "nn config",
    "state",
    "passes",
    "calibration",
    "runtime",
    "api",
    "report inspect artifacts testing",
    "tuning",
    "cli",
    "__init__ __main__",
))
LAYER = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}
# One-release import shims for module paths the docs named before the package was reorganized: each re-exports
# names from the new home and is imported by nothing inside fxquant.
SHIMS = frozenset({"fxquant.cpu", "fxquant.fallback", "fxquant.sensitivity", "fxquant.calibration.launch",
                   "fxquant.kernels.onednn_direct", "fxquant.runner"})
LINE_BUDGET = 400  # lines per source file (tinygrad's line budget is the model)
OPTIONAL = ("transformers", "datasets", "matplotlib", "yaml", "onnx", "onnxruntime", "torchao", "sklearn", "scipy",
            "hypothesis", "pytest", "pandas", "huggingface_hub", "gguf", "safetensors", "tomli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _targets(module: str, path: Path) -> set[str]:
    """The fxquant modules ``module`` imports: ``from pkg import name`` counts as importing ``pkg.name`` where that
    is a module, else ``pkg`` itself (its ``__init__``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == "fxquant")
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        if base.split(".")[0] != "fxquant":
            continue
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            targets.add(candidate if candidate in MODULES else base)
    return {target for target in targets if target in MODULES and target != module}


GRAPH = {module: _targets(module, path) for module, path in MODULES.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer() -> None:
    units = {_unit(module) for module in MODULES if module not in SHIMS}
    assert units <= LAYER.keys(), f"units without a layer in LAYERS: {sorted(units - LAYER.keys())}"


def test_a_module_imports_only_its_own_unit_and_lower_layers() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        if module in SHIMS:
            continue
        unit = _unit(module)
        for target in sorted(targets):
            if target in SHIMS:
                wrong.append(f"{module} imports the shim {target}")
            elif _unit(target) != unit and LAYER[_unit(target)] >= LAYER[unit]:
                wrong.append(f"{module} (layer {LAYER[unit]}) imports {target} (layer {LAYER[_unit(target)]})")
    assert not wrong, "imports against the layer rule (docs/architecture.md):\n" + "\n".join(wrong)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_cycles() -> None:
    """Between modules, a package's ``__init__`` counted as a module of its own."""
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_shims_are_imported_by_nothing_and_only_re_export() -> None:
    for shim in SHIMS:
        path = MODULES.get(shim)
        assert path is not None, f"{shim} listed as a shim but missing"
        body = [node for node in ast.parse(path.read_text()).body
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert all(isinstance(node, ast.Import | ast.ImportFrom | ast.Assign | ast.If) or _is_warning(node)
                   for node in body), f"{shim} does more than re-export"
        assert not any(shim in targets for targets in GRAPH.values()), f"{shim} is imported inside fxquant"


def _is_warning(node: ast.stmt) -> bool:
    call = node.value if isinstance(node, ast.Expr) else None
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "warn"


@pytest.mark.parametrize("path", sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h"),
                                         *(ROOT / "scripts").glob("*.py")]), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_within_the_line_budget(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= LINE_BUDGET, f"{path.relative_to(ROOT)} has {lines} lines (budget {LINE_BUDGET}): split it by job"


def test_import_fxquant_pulls_in_no_optional_dependency() -> None:
    code = ("import sys, fxquant\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert not loaded, f"import fxquant imported optional dependencies: {loaded}"


@functools.cache
def _strict_imports() -> dict[str, str]:
    """Each shim imported in one fresh interpreter with DeprecationWarning an error: shim -> the error, or '' where
    the import passed (one interpreter for all: each start-up imports torch)."""
    code = ("import importlib, json\nout = {}\n"
            f"for shim in {sorted(SHIMS)!r}:\n"
            "    try:\n        importlib.import_module(shim)\n        out[shim] = ''\n"
            "    except DeprecationWarning as e:\n        out[shim] = str(e)\n"
            "print(json.dumps(out))")
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                          text=True, check=True)
    return dict(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_a_shim_warns_once_and_hands_out_the_new_objects(shim: str) -> None:
    assert "moved to fxquant." in _strict_imports()[shim], _strict_imports()
    with pytest.warns(DeprecationWarning, match="moved to"):
        module = importlib.import_module(shim) if shim not in sys.modules else importlib.reload(sys.modules[shim])
    home = importlib.import_module(module.__doc__.split(":mod:`")[1].split("`")[0])
    assert all(getattr(module, name) is getattr(home, name) for name in module.__all__)

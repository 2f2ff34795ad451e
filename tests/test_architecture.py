"""The package's shape, checked statically (no process starts; runs in about a second).

docs/architecture.md draws the layers; these tests keep the code to the drawing:
* no import cycle between modules, counting imports inside functions too (a lazy import is
  still a dependency: it only moves the failure to the first call);
* the layers import downwards only (``common``/``hardware`` know nothing of launches; the rank
  side never imports the caller side);
* no module reaches into another package's private names;
* every module stays small enough to be read in one sitting.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "gpulaunch"
MAX_LINES = 400
# Modules allowed past MAX_LINES, each with the reason it is one piece.
LONG_MODULES: dict[str, str] = {}
# Which top-level packages each layer may import (besides itself and gpulaunch.errors).
LAYERS = {
    "common": {"hardware"},
    "hardware": set(),
    "options": {"common", "hardware", "caller.fitcheck", "tracking.settings",
                "backends.ray.cluster", "option_checks"},   # value checks delegated to owners
    "option_checks": {"common", "hardware", "caller.fitcheck", "tracking.settings",
                      "backends.ray.cluster"},
    "rank": {"common"},
    "runtime": {"common", "rank"},
    "planner": {"hardware"},
    # jobs sit above the launch pipeline: they build its options and run it, never inside it
    "jobs": {"common", "hardware", "options", "option_checks", "caller", "tracking", "api",
             "backends", "cli_nodes"},
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every gpulaunch module ``name`` imports, anywhere in the file, plus the packages whose
    ``__init__`` Python runs on the way."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    with_parents = set()
    for t in found:
        parts = t.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {t for t in with_parents
            if t in MODULES and t != name and not name.startswith(t + ".")}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_directory_is_a_package():
    # A folder without __init__.py is a namespace package: left out of a built wheel.
    missing = [str(d) for d in SRC.rglob("*") if d.is_dir() and d.name != "__pycache__"
               and not (d / "__init__.py").exists()]
    assert not missing, missing


def test_no_import_cycles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(n):                       # Tarjan's strongly connected components
        index[n] = low[n] = len(index)
        stack.append(n)
        for w in GRAPH[n]:
            if w not in index:
                visit(w)
                low[n] = min(low[n], low[w])
            elif w in stack:
                low[n] = min(low[n], index[w])
        if low[n] == index[n]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == n:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for n in GRAPH:
        if n not in index:
            visit(n)
    assert not cycles, f"import cycles: {cycles}"


def _layer(module: str) -> str:
    return module.split(".", 1)[1] if "." in module else ""


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_downwards_only(layer):
    allowed = LAYERS[layer] | {layer, "errors"}
    # a module allowed by its dotted name brings its packages' __init__ with it, no more
    inits = {a.rsplit(".", i)[0] for a in allowed for i in range(1, a.count(".") + 1)}
    bad = []
    for name, deps in GRAPH.items():
        if not (_layer(name) == layer or _layer(name).startswith(layer + ".")):
            continue
        for d in deps:
            rel = _layer(d)
            if rel and rel not in inits and not any(rel == a or rel.startswith(a + ".")
                                                   for a in allowed):
                bad.append(f"{name} -> {d}")
    assert not bad, bad


def test_no_private_names_across_packages():
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 or \
                    isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        "gpulaunch"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        bad.append(f"{name}: from {'.' * node.level}{node.module or ''} "
                                   f"import {alias.name}")
    assert not bad, bad


def test_modules_are_short():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {n: lines for n, lines in long.items() if lines > MAX_LINES and n not in LONG_MODULES}
    assert not over, f"modules over {MAX_LINES} lines (split them, or name why not): {over}"

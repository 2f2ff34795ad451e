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


# --- one rank runtime, one run controller, one public surface -------------------------------

def _source(module: str) -> str:
    return MODULES[module].read_text()


def test_never_swallow_an_import_error_of_our_own_modules():
    """``try: from .x import y / except ImportError`` hides a renamed module (``gpulaunch plan``
    answered "invalid choice" that way): optional third-party packages only."""
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Try):
                continue
            catches = any(isinstance(h.type, ast.Name) and h.type.id in (
                "ImportError", "ModuleNotFoundError") for h in node.handlers)
            ours = [n for stmt in node.body for n in ast.walk(stmt)
                    if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(
                        "gpulaunch"))]
            if catches and ours:
                bad.append(f"{name}:{node.lineno}")
    assert not bad, bad


def test_the_warm_pool_runs_the_cold_rank_body():
    """pool_worker and worker both hand the user's call to rank/body.py; neither records a
    result or an error itself."""
    for module in ("gpulaunch.rank.worker", "gpulaunch.rank.pool_worker"):
        src = _source(module)
        assert "body.run_call(" in src and "body.RankFiles(" in src, module
        for own in ("exception_record", "results.write", "postmortem", "debugger.serve",
                    "StallWatchdog"):
            assert own not in src, f"{module} records {own} itself"
    assert "from .worker import" not in _source("gpulaunch.rank.pool_worker")


def test_one_rank_environment_and_one_hang_routine():
    for module in ("gpulaunch.backends.local.agent", "gpulaunch.backends.local.pool_ranks"):
        src = _source(module)
        assert "rank_env(" in src and "TORCH_NCCL" not in src, module
    for module in ("gpulaunch.backends.local.agent", "gpulaunch.backends.local.pool"):
        src = _source(module)
        assert "hang.record_hang(" in src and "dump_request" not in src.lower(), module


BACKEND_RUNS = ("gpulaunch.backends.local.run", "gpulaunch.backends.local.pool",
                "gpulaunch.backends.ray.run", "gpulaunch.backends.ray.program_run")


@pytest.mark.parametrize("module", BACKEND_RUNS)
def test_backends_leave_the_lifecycle_to_the_controller(module):
    """No backend spells a state ladder, a deadline or an end sequence of its own: they start,
    poll and stop (caller/controller.py holds the rest)."""
    src = _source(module)
    tree = ast.parse(src)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)
               and any(getattr(b, "id", None) == "RunController" for b in n.bases)]
    assert classes, f"{module}: no RunController subclass"
    for cls in classes:
        defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert not defined & {"state", "poll", "stop", "start"}, (module, defined)
    for spelled in ("ACTIVE.discard", "callbacks.on_end", "on_poll", "on_start",
                    "_deadline", "StopReason.TIMEOUT:"):
        assert spelled not in src, f"{module} spells {spelled}"


def test_the_handle_uses_only_declared_members():
    assert "getattr(" not in _source("gpulaunch.caller.handle")


def test_every_public_name_is_in_the_api_module():
    """``import gpulaunch`` offers the API module's names, the errors, the options object and
    the runtime/compute modules; nothing straight out of internals (backends, caller)."""
    tree = ast.parse(_source("gpulaunch"))
    sources = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                sources[alias.asname or alias.name] = node.module or ""
    exported = next(n for n in tree.body if isinstance(n, ast.Assign)
                    and n.targets[0].id == "__all__")
    names = ast.literal_eval(exported.value)
    public = {"api", "errors", "options", "compute", ""}
    bad = {n: sources.get(n) for n in names if sources.get(n) not in public}
    assert not bad, f"public names that come from internals: {bad}"
    api_all = ast.literal_eval(next(n for n in ast.parse(_source("gpulaunch.api")).body
                                    if isinstance(n, ast.Assign)
                                    and n.targets[0].id == "__all__").value)
    from_api = {n for n in names if sources.get(n) == "api"}
    assert from_api <= set(api_all), from_api - set(api_all)

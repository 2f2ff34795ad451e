"""Every code block of README.md, docs/*.md and recipes/*.md runs as written (doc_blocks.py says how a block is
marked): Python blocks in a fresh interpreter, shell blocks with ``bash -e``, on CPU workers, in a
scratch directory that sees the checkout's folders. Blocks marked ``fragment`` must still parse,
import only ``gpulaunch`` names that exist and use only command lines the CLI accepts; blocks
marked ``gpu`` get the same checks here (they need CUDA GPUs to run)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, python_env
from doc_blocks import Block, doc_files, extract, gpulaunch_argv, gpulaunch_imports, shell_commands

BLOCKS = [b for f in doc_files(ROOT) for b in extract(f.read_text(), f.relative_to(ROOT))]
TIMEOUT = 300
SLOW_TIMEOUT = 1200       # a slow-marked block (a benchmark's smoke run) on a loaded 2-core host


def _param(b: Block):
    marks = [pytest.mark.slow, pytest.mark.timeout(SLOW_TIMEOUT + 60)] if "slow" in b.marks \
        else []
    return pytest.param(b, id=b.id, marks=marks)


def _scratch(tmp_path: Path) -> Path:
    """A working directory whose top-level entries are the checkout's (so ``bench/...``,
    ``scripts/...`` and ``src`` resolve) while what a block writes stays in the test's tmp."""
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv"} and not entry.name.startswith(".pytest"):
            (work / entry.name).symlink_to(entry)
    return work


def run_block(block: Block, tmp_path: Path) -> subprocess.CompletedProcess:
    env = python_env({"PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                               os.environ.get("PATH", "")]),
                      "OUT": str(tmp_path / "out"), "GPULAUNCH_FORCE_CPU": "1"})
    (tmp_path / "out").mkdir(exist_ok=True)
    cwd = _scratch(tmp_path)
    if block.lang == "python":
        cmd = [sys.executable, "-c", block.code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=SLOW_TIMEOUT if "slow" in block.marks else TIMEOUT)


def check_fragment(block: Block) -> list[str]:
    """What is wrong with a block that is not run: syntax, gpulaunch imports, CLI lines."""
    problems: list[str] = []
    if block.lang == "python":
        try:
            imports = gpulaunch_imports(block.code)
        except SyntaxError as e:
            return [f"not valid Python: {e}"]
        for module, name in imports:
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                problems.append(f"import {module}: {e}")
                continue
            if name not in (None, "*") and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    problems.append(f"from {module} import {name}: no such name")
        return problems
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
    if syntax.returncode:
        problems.append(f"not valid bash: {syntax.stderr.strip()}")
    from gpulaunch.cli import build_parser
    for command in shell_commands(block.code):
        argv = gpulaunch_argv(command)
        if argv is None:
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            if e.code:
                problems.append(f"the CLI refuses: {command}")
    return problems


def _report(block: Block, r: subprocess.CompletedProcess) -> str:
    return (f"{block.path}:{block.line} ({block.lang}) failed with exit {r.returncode}\n"
            f"--- block ---\n{block.code}--- stdout (tail) ---\n{r.stdout[-3000:]}\n"
            f"--- stderr (tail) ---\n{r.stderr[-3000:]}")


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if not b.marks & {"gpu", "fragment"}])
def test_doc_block_runs(block, tmp_path):
    r = run_block(block, tmp_path)
    assert r.returncode == 0, _report(block, r)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS
                                   if b.marks & {"gpu", "fragment"}])
def test_doc_block_that_is_not_run_here_is_still_valid(block):
    assert not check_fragment(block), check_fragment(block)


# --- the checker itself: it catches a broken block -------------------------------------------

BROKEN = textwrap.dedent('''\
    # Title

    <!-- fragment -->
    ```python
    from gpulaunch.planner.cli import add_parser
    ```

    ```python
    from gpulaunch import distributed
    raise SystemExit(3)
    ```

    ```bash
    gpulaunch plan llama-3.1-8b --no-such-flag
    ```

    <!-- fragment -->
    ```bash
    gpulaunch plann llama-3.1-8b
    ```

    ```text
    not code
    ```
''')


@pytest.mark.unit
def test_extractor_finds_the_code_blocks_and_their_marks():
    blocks = extract(BROKEN, Path("broken.md"))
    assert [(b.line, b.lang, b.marks) for b in blocks] == [
        (4, "python", {"fragment"}), (8, "python", set()), (13, "shell", set()),
        (18, "shell", {"fragment"})]
    assert shell_commands("a \\\n  b  # c\n# d\n\ne\n") == ["a    b  # c", "e"]
    assert gpulaunch_argv("FOO=1 srun --nodes=2 gpulaunch run x.py") == ["run", "x.py"]
    assert gpulaunch_argv("python -m gpulaunch plan m") == ["plan", "m"]
    with pytest.raises(ValueError, match="unknown doc-block mark"):
        extract("<!-- gpus -->\n```python\npass\n```\n")


@pytest.mark.unit
def test_a_renamed_module_in_a_fragment_fails():
    fragment = extract(BROKEN, Path("broken.md"))[0]
    assert check_fragment(fragment) == [
        "import gpulaunch.planner.cli: No module named 'gpulaunch.planner.cli'"]


def test_a_broken_block_fails(tmp_path):
    """A planted break (a failing Python block, a flag the CLI refuses, a renamed command in a
    fragment) fails the checks that the real docs pass."""
    blocks = extract(BROKEN, Path("broken.md"))
    r = run_block(blocks[1], tmp_path)
    assert r.returncode == 3
    (tmp_path / "b").mkdir()
    r = run_block(blocks[2], tmp_path / "b")
    assert r.returncode == 2 and "--no-such-flag" in r.stderr
    assert check_fragment(blocks[3]) == ["the CLI refuses: gpulaunch plann llama-3.1-8b"]

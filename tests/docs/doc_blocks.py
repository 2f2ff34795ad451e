"""Code blocks of the Markdown docs, as a user would copy them.

A fenced block labelled ``python`` or a shell (``bash``, ``sh``, ``shell``) is code; any other
fence (none, ``text``, ``yaml``, ...) is output or a listing and is not run. An HTML comment on
the line right above the fence says how a code block is checked:

``<!-- gpu -->``        needs CUDA GPUs (a benchmark on the lent GPU machine): not run on CPU
                        hosts, checked as a fragment is;
``<!-- fragment -->``   an excerpt that needs the reader's own code, data or machines (a model
                        builder, a second host, a Slurm allocation): not run, but it must parse,
                        every ``gpulaunch`` name it imports must exist and every ``gpulaunch``
                        command line in it must be accepted by the CLI;
``<!-- slow -->``       run, in the slow tier.

Every other code block runs as written: Python in a fresh interpreter, shell with ``bash -e``,
both on CPU workers in a scratch directory that sees the checkout's top-level folders.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
MARKS = {"gpu", "fragment", "slow"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<lang>[\w+-]*)[^\n]*$")
_MARK = re.compile(r"^\s*<!--\s*([\w-]+(?:\s*,\s*[\w-]+)*)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int                    # 1-based line of the opening fence
    lang: str                    # "python" or "shell"
    code: str
    marks: set[str] = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


def extract(text: str, path: Path = Path("<text>")) -> list[Block]:
    """Every code block of a Markdown text, with the marks of the comment above its fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group("fence"), m.group("lang").lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m.group("indent")):])
            i += 1
        i += 1                                            # the closing fence
        kind = "python" if lang in PYTHON else "shell" if lang in SHELL else None
        if kind is None:
            continue
        marks: set[str] = set()
        j = start - 1
        while j >= 0 and (c := _MARK.match(lines[j])):
            marks |= {w.strip() for w in c.group(1).split(",")}
            j -= 1
        unknown = marks - MARKS
        if unknown:
            raise ValueError(f"{path}:{start + 1}: unknown doc-block mark(s) {sorted(unknown)}; "
                             f"known: {sorted(MARKS)}")
        blocks.append(Block(path, start + 1, kind, "\n".join(body) + "\n", marks))
    return blocks


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("**/*.md")),
            *sorted((root / "recipes").glob("**/*.md"))]


def shell_commands(code: str) -> list[str]:
    """The block's command lines, continuation lines joined, comments and blank lines gone."""
    out, cur = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append((cur + line).strip())
        cur = ""
    if cur:
        out.append(cur.strip())
    return out


def gpulaunch_argv(command: str) -> list[str] | None:
    """The arguments of a ``gpulaunch ...`` (or ``python -m gpulaunch ...``) command line."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]                                  # VAR=value prefixes
    if words[:1] == ["srun"]:                               # srun [options] gpulaunch ...
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
    if words and Path(words[0]).name == "gpulaunch":
        return words[1:]
    if len(words) > 2 and words[1:3] == ["-m", "gpulaunch"]:
        return words[3:]
    return None


def gpulaunch_imports(code: str) -> list[tuple[str, str | None]]:
    """(module, name) for each ``import gpulaunch...`` / ``from gpulaunch... import name``."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.split(".")[0] == "gpulaunch"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "gpulaunch":
            out += [(node.module, a.name) for a in node.names]
    return out

"""The code a job runs: a copy of ``code.dir`` taken at submission, so edits made afterwards
never change a job that is queued or retrying.

Which files: inside a git work tree, git's own answer (``git ls-files --cached --others
--exclude-standard``: every .gitignore, .git/info/exclude and the global excludes, exactly as
git reads them); elsewhere the .gitignore files found in the folder, read with pathspec's
git-compatible rules. ``code.exclude`` patterns are applied on top, and .git/ never travels.

The copy is named by a hash of its content (paths, executable bits, bytes), stored once under
``<home>/snapshots/<hash>`` and shared by every job submitted with the same code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pathspec

from ..common import rundir
from .specfile import SpecError

COMPLETE = ".gpulaunch-snapshot"


def _git_files(root: Path) -> list[str] | None:
    if shutil.which("git") is None:
        return None
    try:
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=root,
                                capture_output=True, text=True, timeout=30)
        if inside.stdout.strip() != "true":
            return None
        p = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    names = [n for n in p.stdout.decode(errors="surrogateescape").split("\0") if n]
    return [n for n in names if (root / n).is_file()]      # deleted but still in the index


def _walk_files(root: Path) -> list[str]:
    """Every file under ``root`` that the .gitignore files on its way do not exclude."""
    out = []
    specs: list[tuple[str, pathspec.GitIgnoreSpec]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        if ".gitignore" in filenames:
            lines = (Path(dirpath) / ".gitignore").read_text(errors="replace").splitlines()
            specs.append((rel_dir, pathspec.GitIgnoreSpec.from_lines(lines)))
        active = [(base, s) for base, s in specs if rel_dir.startswith(base)]

        def ignored(rel: str) -> bool:
            return any(s.match_file(rel[len(base):]) for base, s in active)

        dirnames[:] = sorted(d for d in dirnames
                             if d != ".git" and not ignored(f"{rel_dir}{d}/"))
        out.extend(f"{rel_dir}{f}" for f in sorted(filenames) if not ignored(f"{rel_dir}{f}"))
    return out


def list_files(root: Path, exclude: list[str] = ()) -> list[str]:
    files = _git_files(root)
    if files is None:
        files = _walk_files(root)
    extra = pathspec.GitIgnoreSpec.from_lines(list(exclude)) if exclude else None
    keep = sorted(f for f in files if not f.startswith(".git/")
                  and not (extra and extra.match_file(f)))
    return keep


def content_hash(root: Path, files: list[str]) -> str:
    h = hashlib.sha256()
    for rel in files:
        p = root / rel
        h.update(rel.encode(errors="surrogateescape") + b"\0")
        h.update(b"x" if os.access(p, os.X_OK) else b"-")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


def snapshots_root() -> Path:
    return rundir.home() / "snapshots"


def take(root: Path, *, exclude: list[str] = (), max_mb: float = 200.0) -> tuple[str, Path, int]:
    """(hash, folder of the copy, number of files). Refuses a snapshot over ``max_mb``."""
    root = Path(root)
    files = list_files(root, exclude)
    size = sum((root / f).stat().st_size for f in files)
    if size > max_mb * 1e6:
        biggest = sorted(files, key=lambda f: (root / f).stat().st_size)[-3:]
        raise SpecError(f"code.dir {root} holds {size / 1e6:.0f} MB after .gitignore (limit "
                        f"code.max_mb={max_mb:g}); largest: {', '.join(biggest)}. Leave data and "
                        "checkpoints out with .gitignore or code.exclude, or raise code.max_mb")
    digest = content_hash(root, files)
    dest = snapshots_root() / digest
    if (dest / COMPLETE).exists():
        return digest, dest, len(files)
    snapshots_root().mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = snapshots_root() / f".{digest}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel in files:
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    (tmp / COMPLETE).write_text(f"{len(files)} files from {root}\n")
    try:
        os.rename(tmp, dest)
    except OSError:              # another submission stored the same content meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return digest, dest, len(files)

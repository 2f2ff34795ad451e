"""Owner-only files and folders under the gpulaunch home (0700 folders, 0600 files), made so
at creation: ``mkdir`` and ``open``'s modes are masked by the umask, and the caller's umask is
the user's (a notebook's), never ours to change. ``tighten`` takes the group and other bits off
a tree that a library (MLflow's artifact store) created with the umask's modes."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def mkdir(path: os.PathLike | str) -> Path:
    """``mkdir -p`` where every folder it creates is 0700 (an existing one is left as it is)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)
    return path


def open_file(path: os.PathLike | str, mode: str = "w", **kw):
    """``open(path, mode)`` for "w", "a", "wb", "ab": a new file is created 0600."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    return open(fd, mode, **kw)


def tighten(root: os.PathLike | str) -> None:
    """Drop group and other permissions from ``root`` and everything under it (symlinks are
    left alone). Missing paths and races with a concurrent writer are ignored."""
    if not os.path.isdir(root):
        tighten_one(root)
        return
    for base, dirs, files in os.walk(root):
        for name in [base, *(os.path.join(base, n) for n in dirs + files)]:
            tighten_one(name)


def tighten_one(name) -> None:
    """``tighten`` for one path, not what is under it."""
    try:
        st = os.lstat(name)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
            os.chmod(name, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass

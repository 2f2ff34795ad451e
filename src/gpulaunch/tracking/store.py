"""gpulaunch's own MLflow store (sqlite under the gpulaunch home): serialised creation, owner-only
files, and the one line that says where a process's runs go."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ..common import private
from . import settings

_ANNOUNCED: set[str] = set()


def announce(uri: str) -> bool:
    """True the first time a process tracks into ``uri``."""
    if uri in _ANNOUNCED:
        return False
    _ANNOUNCED.add(uri)
    return True


@contextlib.contextmanager
def sqlite_create_lock(uri: str):
    """Serialise first use of a sqlite store between processes: MLflow builds the schema on
    first open, and concurrent launches on a new store otherwise fail in its migrations
    ("duplicate column name") or stall."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl
    path = Path(uri[len("sqlite:///"):] + ".lock")
    private.mkdir(path.parent)
    with private.open_file(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tighten_artifacts(info: dict) -> None:
    """MLflow creates the default store's artifact folders with the umask's modes: make this
    run's owner-only (and the folders above it, up to the artifact root)."""
    root = Path(settings.default_artifact_root())
    exp = root / str(info.get("experiment_name") or "").replace("/", "_")
    for folder in (root, exp):
        private.tighten_one(folder)
    private.tighten(exp / info["run_id"])

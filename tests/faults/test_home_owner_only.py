"""Everything under the gpulaunch home is owner-only after cold and warm calls, tracked ones
included: run dirs, rank logs, agent.log, attempt dirs, stacks files, pools/, the default MLflow
store (its database and artifact folders)."""

from __future__ import annotations

import os
import stat

import pytest

import gpulaunch
import gpulaunch.tracking
from gpulaunch import distributed

pytest.importorskip("mlflow")


def chatty():
    import sys
    print("to stdout")
    print("to stderr", file=sys.stderr)
    return 1


def readable_by_others(home) -> list[str]:
    bad = []
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                bad.append(f"{oct(stat.S_IMODE(mode))} {os.path.relpath(path, home)}")
    return bad


@pytest.mark.slow
def test_cold_and_warm_calls_leave_nothing_readable_by_others(gpulaunch_home, monkeypatch):
    monkeypatch.setenv("GPULAUNCH_TRACKING", "1")
    old = os.umask(0o022)                       # the usual umask: group/other may read
    try:
        assert distributed(gpus=2, stream_logs="none")(chatty).distributed() == [1, 1]
        warm = distributed(gpus=2, keep_alive=30, stream_logs="none")(chatty)
        assert warm.distributed() == [1, 1]
        assert warm.distributed() == [1, 1]     # served by the pool
        assert gpulaunch.tracking.flush(timeout=120)   # the runs' MLflow ends (uploads)
    finally:
        gpulaunch.shutdown()
        os.umask(old)
    assert (gpulaunch_home / "pools").is_dir() and (gpulaunch_home / "mlartifacts").is_dir()
    assert readable_by_others(gpulaunch_home) == []

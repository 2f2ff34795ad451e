"""Shared fixtures. Every launch in the tests is real: real processes, real gloo collectives."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def gpulaunch_home(tmp_path, monkeypatch):
    """Each test gets its own run-directory root, and CPU workers even on a GPU host."""
    monkeypatch.setenv("GPULAUNCH_HOME", str(tmp_path / "gpulaunch-home"))
    monkeypatch.setenv("GPULAUNCH_FORCE_CPU", "1")
    monkeypatch.setenv("GPULAUNCH_QUIET", "1")
    # MLflow tracking is on by default when mlflow is installed; tests opt in
    # (tests/tracking/test_tracking.py) so the rest of the suite does not pay an MLflow import
    # and a store per launch.
    monkeypatch.setenv("GPULAUNCH_TRACKING", "0")
    yield tmp_path / "gpulaunch-home"


def run_pids(run_dir) -> set[int]:
    """Every pid a run recorded: the agent and each rank of each attempt."""
    from gpulaunch.common.rundir import RunDir
    run = RunDir(run_dir)
    pids = set(run.rank_pids())
    status = run.status()
    if status.agent_pid:
        pids.add(status.agent_pid)
    return pids


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_no_survivors(run_dir, wait: float = 5.0) -> None:
    pids = run_pids(run_dir)
    assert pids, f"the run at {run_dir} recorded no pids; cannot check hygiene"
    deadline = time.monotonic() + wait
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"processes of the run survived: {alive(pids)}"


def latest_run_dir(home: Path) -> Path:
    runs = sorted((home / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return runs[-1]


def python_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if extra:
        env.update(extra)
    return env


PY = sys.executable


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (``item.rep_call``), so a fixture's teardown
    can tell whether the test itself passed."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


# Test tiers (pyproject's markers; scripts/test.sh -m unit runs one): ``unit`` is marked by hand
# on pure tests, ``gpu`` and ``slow`` by hand too; every other test is ``integration``.
TIERS = ("unit", "slow", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.integration)


class _NoProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A ``unit`` test starts no process: the unit tier stays a few seconds on any machine."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import subprocess

    def refuse(*args, **kwargs):
        raise _NoProcess(f"{request.node.nodeid} is marked unit but starts a process; "
                         "mark it integration (the default) instead")
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    if hasattr(os, "posix_spawn"):
        monkeypatch.setattr(os, "posix_spawn", refuse)
    yield

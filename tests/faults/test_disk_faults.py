"""Disk hygiene (issue 17): the payload goes as soon as no rank can need it, old run
directories are pruned by a retention policy, never a running one.

Real launches (CPU workers, real files); the retention tests build real run directories whose
records say what a finished, a running and a crashed run leave."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import PY, latest_run_dir, python_env

from gpulaunch import distributed
from gpulaunch.common import retention
from gpulaunch.common.records import NodeState, NodeStatus
from gpulaunch.common.rundir import RunDir, write_json_atomic


def _payload_gone_while_running():
    """Runs in each rank: wait (bounded) until the agent has deleted payload.pkl."""
    import os
    import time
    path = os.path.join(os.environ["GPULAUNCH_RUN_DIR"], "payload.pkl")
    deadline = time.monotonic() + 20
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_payload_is_deleted_once_every_rank_loaded_it(gpulaunch_home):
    big = b"x" * (1 << 20)           # an argument with weight, as a notebook would pass

    def f(blob):
        assert len(blob) == 1 << 20
        return _payload_gone_while_running()

    assert distributed(gpus=2)(f).distributed(big) == [True, True]
    run = RunDir(latest_run_dir(gpulaunch_home))
    assert not run.payload.exists()
    assert sorted(p.name for p in run.attempt_dir(0).glob("*.loaded")) == \
        ["rank0.loaded", "rank1.loaded"]


def test_payload_is_deleted_when_the_run_fails(gpulaunch_home):
    def boom():
        raise ValueError("no")

    with pytest.raises(ValueError):
        distributed(gpus=2)(boom).distributed()
    assert not RunDir(latest_run_dir(gpulaunch_home)).payload.exists()


def _fails_first_attempt():
    import os
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        raise RuntimeError("attempt 0 fails after loading the payload")
    return int(os.environ["RANK"])


def test_payload_survives_until_the_last_attempt_loaded_it(gpulaunch_home):
    # a restarted attempt loads the payload again: deleting it after attempt 0 would break it
    assert distributed(gpus=2, max_restarts=1)(_fails_first_attempt).distributed() == [0, 1]
    run = RunDir(latest_run_dir(gpulaunch_home))
    assert run.loaded_count(1) == 2
    assert not run.payload.exists()


# ------------------------------------------------------------------------------ retention
def _fake_run(root, name: str, *, age_days: float, state=NodeState.SUCCEEDED,
              agent_pid: int | None = None, payload: bool = True) -> RunDir:
    path = root / name
    (path / "attempt0").mkdir(parents=True)
    run = RunDir(path)
    run.write_status(NodeStatus(state=state, agent_pid=agent_pid))
    if payload:
        run.payload.write_bytes(b"p" * 100)
    t = time.time() - age_days * 86400
    for p in (path / "attempt0", path):
        os.utime(p, (t, t))
    return run


def _dead_pid() -> int:
    proc = subprocess.Popen([PY, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("quick", [False, True])     # quick: the pipeline's prune per launch
def test_retention_keeps_newest_and_recent_and_never_a_running_run(tmp_path, quick):
    root = tmp_path / "runs"
    old = [_fake_run(root, f"old{i}", age_days=30 + i) for i in range(4)]
    recent = _fake_run(root, "recent", age_days=0.5)
    running = _fake_run(root, "running", age_days=60, state=NodeState.RUNNING,
                        agent_pid=os.getpid())
    crashed = _fake_run(root, "crashed", age_days=40, state=NodeState.RUNNING,
                        agent_pid=_dead_pid())
    report = retention.prune(retention.Policy(keep_runs=2, keep_days=7), root=root, quick=quick)
    left = sorted(p.name for p in root.iterdir())
    # newest two by time: recent and old0 (running is active, counted but never removed)
    assert left == ["old0", "recent", "running"], report
    assert sorted(report.removed) == ["crashed", "old1", "old2", "old3"]
    assert report.kept_active == ["running"]
    # a kept, finished run loses its payload; a running one keeps it
    assert not recent.payload.exists() and not old[0].payload.exists()
    assert running.payload.exists()
    assert not crashed.path.exists()


def test_quick_retention_counts_kept_runs_without_a_payload_and_still_removes_old_ones(tmp_path):
    """The pipeline's prune after each launch (quick=True) does not read kept runs that have no
    payload left, but removes and protects as the full one does."""
    root = tmp_path / "runs"
    kept = [_fake_run(root, f"k{i}", age_days=0.1 * i, payload=False) for i in range(3)]
    kept.append(_fake_run(root, "script-run", age_days=0.2, payload=False,    # not even read
                          state=NodeState.RUNNING, agent_pid=os.getpid()))
    active = _fake_run(root, "active", age_days=0.5, state=NodeState.RUNNING,
                       agent_pid=os.getpid())                       # a payload still unread
    old = _fake_run(root, "old", age_days=30, payload=False)
    report = retention.prune(retention.Policy(keep_runs=2, keep_days=7), root=root, quick=True)
    assert report.removed == ["old"] and not old.path.exists()
    assert all(r.path.exists() for r in kept) and active.payload.exists()
    assert report.kept_active == ["active"] and report.kept == 4


def test_retention_bound_per_call_and_env_settings(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    for i in range(5):
        _fake_run(root, f"r{i}", age_days=10 + i)
    monkeypatch.setenv("GPULAUNCH_KEEP_RUNS", "0")
    monkeypatch.setenv("GPULAUNCH_KEEP_DAYS", "1.5")
    policy = retention.Policy.from_env()
    assert policy == retention.Policy(keep_runs=0, keep_days=1.5)
    assert len(retention.prune(policy, root=root, max_removals=2).removed) == 2
    assert len(list(root.iterdir())) == 3
    monkeypatch.setenv("GPULAUNCH_KEEP_RUNS", "lots")
    with pytest.raises(ValueError, match="GPULAUNCH_KEEP_RUNS='lots'"):
        retention.Policy.from_env()


def test_a_launch_being_set_up_is_never_pruned(tmp_path):
    # no status.json yet: the caller (alive, this host) is still preparing the launch
    root = tmp_path / "runs"
    path = root / "setting-up"
    path.mkdir(parents=True)
    from gpulaunch.common.rundir import hostname
    write_json_atomic(path / "launch.json", {"caller_pid": os.getpid(), "host": hostname()})
    t = time.time() - 30 * 86400
    os.utime(path, (t, t))
    report = retention.prune(retention.Policy(keep_runs=0, keep_days=0), root=root)
    assert path.exists() and report.kept_active == ["setting-up"]


def test_runs_gc_on_the_command_line(gpulaunch_home):
    root = gpulaunch_home / "runs"
    for i in range(3):
        _fake_run(root, f"r{i}", age_days=20 + i)
    out = subprocess.run([PY, "-m", "gpulaunch.cli", "runs", "--gc"], capture_output=True,
                         text=True, timeout=60,
                         env=python_env({"GPULAUNCH_KEEP_RUNS": "1", "GPULAUNCH_KEEP_DAYS": "0"}))
    assert out.returncode == 0, out.stderr
    assert "removed 2 run dir(s)" in out.stdout
    assert [p.name for p in root.iterdir()] == ["r0"]


def test_the_pipeline_prunes_after_a_launch(gpulaunch_home, monkeypatch):
    root = gpulaunch_home / "runs"
    for i in range(3):
        _fake_run(root, f"old{i}", age_days=20 + i)
    monkeypatch.setenv("GPULAUNCH_KEEP_RUNS", "1")
    monkeypatch.setenv("GPULAUNCH_KEEP_DAYS", "0")
    assert distributed(gpus=1)(lambda: 5).distributed() == [5]
    deadline = time.monotonic() + 20
    while any(p.name.startswith("old") for p in root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p.name for p in root.iterdir()]
    assert len(left) == 1 and not left[0].startswith("old"), left


def test_a_ray_run_whose_agent_pid_is_another_machines_is_kept_while_its_caller_lives(tmp_path):
    from gpulaunch.common.rundir import hostname
    root = tmp_path / "runs"
    run = _fake_run(root, "ray-run", age_days=30, state=NodeState.RUNNING, agent_pid=_dead_pid())
    write_json_atomic(run.launch_json, {"caller_pid": os.getpid(), "host": hostname()})
    t = time.time() - 30 * 86400
    os.utime(run.path, (t, t))
    report = retention.prune(retention.Policy(keep_runs=0, keep_days=0), root=root)
    assert run.path.exists() and report.kept_active == ["ray-run"]
    assert run.payload.exists()

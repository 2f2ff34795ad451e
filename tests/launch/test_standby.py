"""The standby agent (backends/local/standby.py): after a run, the next run's agent is started
ahead with torch imported. It must be invisible to the user except for speed: the ranks of a
warm run see the caller's environment and working directory *at the time of the call*, a
changed start-up variable falls back to a cold start, and no standby outlives its caller.

Every launch here is real (agent processes, forked ranks, gloo). Nothing asserts on time:
whether a run started warm is read from the agent's own status file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import PY, alive, python_env

from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.backends.local.standby import STANDBY
from gpulaunch.common.rundir import RunDir


def _what_a_rank_sees():
    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": t.item(), "var": os.environ.get("GL_TEST_VAR"), "cwd": os.getcwd(),
            "omp": os.environ.get("OMP_PROC_BIND"), "run_dir": os.environ["GPULAUNCH_RUN_DIR"]}


def _warm(result: dict) -> bool:
    return bool(RunDir(result["run_dir"]).status().warm_start)


def _wait_standby_ready(timeout: float = 120.0) -> int:
    """The standby's pid once it has imported the agent (it then waits for a run)."""
    assert STANDBY.pid() is not None, "no standby agent was started after the run"
    assert STANDBY.wait_ready(timeout), "the standby agent did not get ready"
    return STANDBY.pid()


def test_second_launch_is_warm_and_sees_the_callers_env_and_cwd_of_that_call(
        tmp_path, monkeypatch):
    fn = distributed(gpus=2, stream_logs="none")(_what_a_rank_sees)
    monkeypatch.setenv("GL_TEST_VAR", "first")
    first = fn.distributed()
    assert [r["sum"] for r in first] == [2.0, 2.0] and first[0]["var"] == "first"
    standby = _wait_standby_ready()

    monkeypatch.setenv("GL_TEST_VAR", "second")       # changed after the standby started
    monkeypatch.chdir(tmp_path)
    second = fn.distributed()
    assert _warm(second[0]), RunDir(second[0]["run_dir"]).status()
    assert RunDir(second[0]["run_dir"]).status().agent_pid == standby
    assert [r["sum"] for r in second] == [2.0, 2.0]
    assert {r["var"] for r in second} == {"second"}
    assert {r["cwd"] for r in second} == {str(tmp_path)}
    assert STANDBY.pid() != standby or STANDBY.pid() is None   # used once, never reused


def test_a_changed_start_up_variable_discards_the_standby_and_starts_cold(monkeypatch):
    fn = distributed(gpus=2, stream_logs="none")(_what_a_rank_sees)
    fn.distributed()
    old = _wait_standby_ready()
    monkeypatch.setenv("OMP_PROC_BIND", "close")     # read by OpenMP when a process starts
    out = fn.distributed()
    assert not _warm(out[0])
    assert {r["omp"] for r in out} == {"close"}
    deadline = time.monotonic() + 10
    while alive([old]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive([old]), "the discarded standby is still running"


def test_a_standby_that_died_is_replaced_by_a_cold_start():
    fn = distributed(gpus=2, stream_logs="none")(_what_a_rank_sees)
    fn.distributed()
    os.kill(_wait_standby_ready(), signal.SIGKILL)
    out = fn.distributed()
    assert [r["sum"] for r in out] == [2.0, 2.0] and not _warm(out[0])


def test_a_warm_run_is_cancelled_and_fails_like_a_cold_one(gpulaunch_home):
    from conftest import assert_no_survivors
    fn = distributed(gpus=2, stream_logs="none")(_what_a_rank_sees)
    fn.distributed()
    _wait_standby_ready()

    def boom():
        rt.init()
        if rt.get_global_rank() == 1:
            raise ValueError("warm failure")
        import torch.distributed as dist
        dist.barrier()

    with pytest.raises(ValueError, match="warm failure") as info:
        distributed(gpus=2, stream_logs="none")(boom).distributed()
    assert RunDir(info.value.run_dir).status().warm_start
    assert_no_survivors(info.value.run_dir)

    _wait_standby_ready()

    def sleeper():
        import time
        rt.init()
        print("READY", flush=True)
        time.sleep(600)

    handle = distributed(gpus=2)(sleeper).submit()
    deadline = time.monotonic() + 120
    while handle.logs().count("READY") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert RunDir(handle.run_dir).status().warm_start
    handle.cancel()
    assert handle.status == "CANCELLED"
    assert_no_survivors(handle.run_dir)


def test_switched_off_no_standby_is_started(monkeypatch):
    STANDBY.close()
    monkeypatch.setenv("GPULAUNCH_STANDBY", "0")
    out = distributed(gpus=2, stream_logs="none")(_what_a_rank_sees).distributed()
    assert not _warm(out[0])
    time.sleep(0.5)
    assert STANDBY.pid() is None


STANDBY_SCRIPT = '''
import sys, time
from gpulaunch import distributed
from gpulaunch.backends.local.standby import STANDBY

distributed(gpus=2, stream_logs="none")(lambda: 1).distributed()
print("STANDBY", STANDBY.pid(), flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)          # killed by the test while its standby waits
'''


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_standby_outlives_its_caller(tmp_path, how):
    script = tmp_path / "caller.py"
    script.write_text(STANDBY_SCRIPT)
    proc = subprocess.Popen([PY, str(script), "exit" if how == "exit" else "wait"],
                            env=python_env(), stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("STANDBY "), line
        pid = int(line.split()[1])
        assert psutil.pid_exists(pid)
        if how == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)       # no atexit: only the closed pipe tells it
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while alive([pid]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive([pid]), f"the standby agent {pid} outlived its caller ({how})"

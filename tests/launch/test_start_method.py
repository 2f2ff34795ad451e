"""Ranks are forked from the agent by default; a forked rank must look like a spawned one.

Real runs (2 CPU workers, gloo): the start method recorded in status.json, the fallbacks to
spawn, and what a forked rank must not inherit from the agent (its logging configuration,
signal handlers, process group, OpenMP thread count, buffered stdout).
"""

from __future__ import annotations

import pytest
from conftest import assert_no_survivors, latest_run_dir

from gpulaunch import distributed
from gpulaunch.common.rundir import RunDir, read_json
from gpulaunch.errors import ConfigurationError

pytestmark = pytest.mark.slow


def _rank_state():
    import logging
    import os
    import signal
    import sys

    import torch

    from gpulaunch import runtime as rt
    rt.init()
    logging.basicConfig(level=logging.INFO, format="USERLOG %(message)s")  # must take effect
    logging.getLogger("user").info("hello from rank %d", rt.get_global_rank())
    print("PRINTED", flush=False)  # unbuffered stdout: reaches the log without a flush
    return {"own_group": os.getpgid(0) == os.getpid(),
            "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "threads": torch.get_num_threads(), "argv0": os.path.basename(sys.argv[0])}


def test_forked_rank_looks_like_a_spawned_one(gpulaunch_home):
    handle = distributed(gpus=2, stream_logs="none")(_rank_state).submit()
    forked = handle.result(timeout=300)
    assert RunDir(handle.run_dir).status().start_method == "fork"
    logs = handle.logs()
    assert "USERLOG hello from rank 0" in logs and "USERLOG hello from rank 1" in logs
    assert "PRINTED" in logs
    assert_no_survivors(handle.run_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULAUNCH_START_METHOD", "spawn")
        handle = distributed(gpus=2, stream_logs="none")(_rank_state).submit()
        spawned = handle.result(timeout=300)
    assert RunDir(handle.run_dir).status().start_method == "spawn"
    assert forked == spawned
    assert forked[0] == {"own_group": True, "sigterm_default": True, "sigint": True, "threads": 1,
                         "argv0": "worker.py"}


def test_env_read_at_interpreter_start_falls_back_to_spawn(gpulaunch_home):
    f = distributed(gpus=2, stream_logs="none", env={"PYTHONHASHSEED": "123"})(
        lambda: __import__("os").environ["PYTHONHASHSEED"])
    assert f.distributed() == ["123", "123"]
    status = RunDir(latest_run_dir(gpulaunch_home)).status()
    assert status.start_method == "spawn" and "PYTHONHASHSEED" in status.start_method_reason


def test_unknown_start_method_is_refused_before_anything_starts(gpulaunch_home, monkeypatch):
    monkeypatch.setenv("GPULAUNCH_START_METHOD", "forkserver")
    with pytest.raises(ConfigurationError, match="GPULAUNCH_START_METHOD='forkserver'"):
        distributed(gpus=2, stream_logs="none")(lambda: 1).distributed()


def test_no_forked_rank_runs_before_the_last_fork(gpulaunch_home):
    """A rank forked while another rank's connection is being accepted can inherit a held
    glibc lock and hang forever (the agent's store threads resolve peer addresses). So no rank
    may start before the agent has forked the last one: every rank's own start stamp
    (``info.json``, written on its way in) must come after the agent's ``forked_at``, also after
    a restart, and the gate must not leak into the user's environment."""
    def look(fail_first):
        import os

        import torch.distributed as dist

        from gpulaunch import runtime as rt
        rt.init()
        dist.barrier()
        if fail_first and rt.get_restart_count() == 0 and rt.get_global_rank() == 2:
            os._exit(3)
        return "GPULAUNCH_FORK_GATE" in os.environ

    for restarts in (0, 1):
        handle = distributed(gpus=4, stream_logs="none", max_restarts=restarts)(look).submit(
            bool(restarts))
        assert handle.result(timeout=300) == [False] * 4
        run = RunDir(handle.run_dir)
        status = run.status()
        assert status.start_method == "fork"
        forked_at = status.forked_at          # the last attempt's
        attempt = status.attempt
        assert attempt == restarts
        started = {r: read_json(run.rank_file(attempt, r, "info.json"))["started"]
                   for r in range(4)}
        assert all(t >= forked_at for t in started.values()), (forked_at, started)
        assert_no_survivors(handle.run_dir)

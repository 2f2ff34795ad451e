"""A warm call (``keep_alive=``) behaves as a cold one: the same rank body, environment and
hang routine. Each behaviour is checked on both, with real processes (2 CPU ranks, gloo):
a function's ``sys.exit(0)`` is a crash and its peer in a collective does not hang the call;
``debug=True`` serves pdb at the failing frame; a hang dumps every rank's stack; the rank
environment is the same function's; ``max_restarts`` restarts the call, and after a warm pool
restarted cold, reading a dropped ``rt.state`` key says why and what to re-run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT

import gpulaunch
from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.backends.local.pool import POOLS
from gpulaunch.common.rundir import RunDir

KINDS = {"cold": {}, "warm": {"keep_alive": 60}}


@pytest.fixture(params=list(KINDS))
def call(request, monkeypatch):
    """The launch settings of a cold or a warm call (the warm one on a fresh pool)."""
    monkeypatch.delenv("GPULAUNCH_QUIET", raising=False)
    POOLS.close("test start")
    POOLS.last_end, POOLS.dropped = None, None
    yield dict(gpus=2, timeout=120, **KINDS[request.param])
    gpulaunch.shutdown()


def _exit_zero_while_peer_waits():
    import torch
    import torch.distributed as dist
    rt.init()
    if rt.get_global_rank() == 1:
        sys.exit(0)                       # never joins the all_reduce below
    t = torch.ones(1)
    dist.all_reduce(t)                    # rank 0 waits here for a peer that left
    return t.item()


def test_sys_exit_0_in_a_function_is_a_crash_and_the_peer_does_not_hang(call):
    started = time.monotonic()
    with pytest.raises(gpulaunch.WorkerCrashError, match=r"Rank 1 \(host .*\) called "
                       r"sys\.exit\(0\)"):
        distributed(**call)(_exit_zero_while_peer_waits).distributed()
    assert time.monotonic() - started < 60, "the call waited for its timeout"


def _breaks(x):
    from gpulaunch import runtime as rt

    def failing_step(x):
        if rt.get_global_rank() == 1:
            raise ArithmeticError("broke")
        return x

    return failing_step(x * 6)


def _debug_info(run: RunDir, rank: int, timeout: float = 60.0) -> dict:
    path = run.rank_file(0, rank, "debug.json")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no {path}")


def test_debug_serves_pdb_at_the_failing_frame(call):
    h = distributed(stream_logs="none", debug=True, **call)(_breaks).submit(7)
    run = RunDir(h.run_dir)
    info = _debug_info(run, 1)
    assert info["port"] and len(info["token"]) >= 24
    time.sleep(4)                        # longer than the pool's grace for a peer to return
    assert not h.done(), "the run ended while its failing rank waited for a debugger"
    p = subprocess.run([sys.executable, "-m", "gpulaunch", "debug", h.run_id, "--rank", "1"],
                       input="p x\nc\n", capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert p.returncode == 0, p.stderr
    assert "(Pdb) 42\n" in p.stdout
    with pytest.raises(ArithmeticError):
        h.result(timeout=60)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", info["port"]), timeout=2).close()


def _skips_a_collective():
    import time as _t

    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    if rt.get_global_rank() == 1:
        _t.sleep(3600)                        # rank 1 never joins the all_reduce
    dist.all_reduce(t)                        # rank 0 waits here forever
    return t.item()


def test_a_hang_dumps_every_ranks_stack(call):
    started = time.monotonic()
    with pytest.raises(gpulaunch.HangError) as info:
        distributed(hang_timeout=5, **call)(_skips_a_collective).distributed()
    assert time.monotonic() - started < 90
    err = info.value
    assert set(err.stacks) == {0, 1}
    assert "dist.all_reduce(t)" in err.stacks[0]          # the line rank 0 was waiting on
    assert "_t.sleep(3600)" in err.stacks[1]              # and rank 1's
    assert "made no progress for" in str(err)
    assert RunDir(err.run_dir).hang_json.exists()


def _env_of_rank():
    return {k: os.environ.get(k) for k in (
        "GPULAUNCH_RUN_DIR", "GPULAUNCH_DEVICE", "NODE_RANK", "REPLICA_RANK", "OMP_NUM_THREADS",
        "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "RANK", "WORLD_SIZE",
        "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "GPULAUNCH_DEBUG")}


def test_the_rank_environment_is_the_same(call):
    h = distributed(debug=True, **call)(_env_of_rank).submit()
    envs = h.result()
    for rank, env in enumerate(envs):
        assert env["GPULAUNCH_RUN_DIR"] == h.run_dir
        assert env["RANK"] == str(rank)
        assert env == dict(envs[0], RANK=str(rank)), (rank, env)
    assert envs[0] | {"GPULAUNCH_RUN_DIR": None} == {
        "GPULAUNCH_RUN_DIR": None, "GPULAUNCH_DEVICE": "cpu", "NODE_RANK": "0",
        "REPLICA_RANK": "0", "OMP_NUM_THREADS": envs[0]["OMP_NUM_THREADS"],
        "GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "0", "GPULAUNCH_DEBUG": "1"}


@pytest.mark.unit
def test_nccl_flight_recorder_file_is_in_every_rank_env_on_cuda(tmp_path):
    """One function builds the rank environment of a cold rank (node agent) and a warm one
    (pool): on CUDA both point NCCL's dump file into the run directory."""
    from gpulaunch.backends.local.pool_ranks import pool_rank_env
    from gpulaunch.backends.local.rank_env import rank_env
    from gpulaunch.common.records import LaunchSpec
    cuda = LaunchSpec(nproc_per_node=2, device="cuda")
    cold = rank_env({}, cuda, run_dir=tmp_path, node_rank=0, nnodes=1)
    warm = pool_rank_env({}, cuda, 0, 12345, 9, run_dir=tmp_path)
    for env in (cold, warm):
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert {k: v for k, v in warm.items() if k in cold} == cold


def _fails_on_the_first_attempt():
    import os as _os
    rt.init()
    if rt.get_restart_count() == 0 and rt.get_global_rank() == 1:
        _os._exit(7)
    return rt.get_restart_count()


def test_max_restarts_restarts_the_call(call, capfd):
    assert distributed(max_restarts=1, **call)(_fails_on_the_first_attempt).distributed() \
        == [1, 1]
    if "keep_alive" in call:
        out = capfd.readouterr().out
        lines = [x for x in out.splitlines() if "attempt 0 failed" in x]
        assert len(lines) == 1 and "restarting the call on new ranks (attempt 1 of 1)" in \
            lines[0] and "restarted cold" in lines[0], out


def test_a_key_a_pool_restart_dropped_names_the_cause_and_the_call_to_rerun(capfd):
    POOLS.close("test start")
    POOLS.last_end, POOLS.dropped = None, None
    try:
        @distributed(gpus=2, keep_alive=60, timeout=120)
        def load_model():
            rt.state["model"] = f"weights of rank {rt.get_global_rank()}"
            return True

        @distributed(gpus=2, keep_alive=60, timeout=120, max_restarts=1)
        def train():
            import os as _os
            if rt.get_restart_count() == 0 and rt.get_global_rank() == 1:
                _os._exit(7)                     # the pool restarts cold: rt.state is dropped
            return rt.state["model"]

        assert load_model.distributed() == [True, True]
        with pytest.raises(gpulaunch.StateDroppedError) as info:
            train.distributed()
        msg = str(info.value)
        assert "rt.state['model'] is gone: the warm pool restarted cold" in msg, msg
        assert "exit code 7" in msg or "exited" in msg, msg
        assert "re-run load_model.distributed(...)" in msg, msg
        out = capfd.readouterr().out
        assert "its rt.state was dropped (model)" in out, out
    finally:
        gpulaunch.shutdown()

"""The warm rank pool (``keep_alive=``), with real processes: 2 CPU ranks, gloo.

What is checked: state and processes persist across calls of different functions; a Python
exception every rank survives keeps the pool; a crash, a timeout, a hang and a cancel each tear
it down and the next call starts cold (saying why) and succeeds; other settings, a changed
installed distribution, shutdown() and the caller's SIGKILL release or replace the ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import ROOT, alive

import gpulaunch
from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.backends.local.pool import POOLS

POOL = dict(gpus=2, keep_alive=60, timeout=120)


@pytest.fixture(autouse=True)
def _fresh_pool(monkeypatch):
    monkeypatch.delenv("GPULAUNCH_QUIET", raising=False)   # the "why cold" line is checked
    POOLS.close("test start")
    POOLS.last_end = None
    yield
    gpulaunch.shutdown()


@distributed(**POOL)
def load(value):
    import torch
    import torch.distributed as dist
    rt.init()
    rt.state["loaded"] = value + rt.get_global_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()          # as a cold function ends: a no-op inside a pool
    return os.getpid(), t.item()


@distributed(**POOL)
def use():
    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1) * (rt.get_global_rank() + 1)
    dist.all_reduce(t)
    print(f"use on rank {rt.get_global_rank()}")
    return os.getpid(), rt.state.get("loaded"), t.item()


@distributed(**POOL)
def fail_everywhere():
    raise ValueError(f"bad input on rank {rt.get_global_rank()}")


@distributed(**POOL)
def crash_rank1():
    if rt.get_global_rank() == 1:
        os._exit(3)
    time.sleep(30)


@distributed(**POOL)
def raise_rank1_while_peer_waits():
    import torch
    import torch.distributed as dist
    rt.init()
    if rt.get_global_rank() == 1:
        raise KeyError("only rank 1")
    dist.all_reduce(torch.ones(1))        # never completes: rank 1 is not coming


@distributed(**POOL)
def sleep_long():
    print("sleeping", flush=True)
    time.sleep(60)


def pids_of(results) -> list[int]:
    return [r[0] for r in results]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def gone(pids, wait: float = 10.0) -> bool:
    deadline = time.monotonic() + wait
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pids)


def test_state_and_ranks_persist_across_two_functions(capsys):
    first = load.distributed(100)
    assert [r[1] for r in first] == [2.0, 2.0]
    procs_before = children()
    second = use.distributed()
    assert children() == procs_before, "the second call created or lost processes"
    assert pids_of(second) == pids_of(first)
    assert [r[1] for r in second] == [100, 101]          # rt.state from the first call
    assert [r[2] for r in second] == [3.0, 3.0]          # the group still works
    out = capsys.readouterr().out
    assert "[rank 0] use on rank 0" in out and "[rank 1] use on rank 1" in out
    status = [line for line in out.splitlines() if "warm pool" in line]
    assert status, out


def test_the_caller_never_imports_torch():
    code = textwrap.dedent("""
        import sys, gpulaunch
        from gpulaunch import distributed
        @distributed(gpus=2, keep_alive=30)
        def f():
            import os
            return os.getpid()
        a = f.distributed(); b = f.distributed()
        assert a == b, (a, b)
        assert "torch" not in sys.modules, "the caller imported torch"
        gpulaunch.shutdown()
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_an_exception_on_every_rank_keeps_the_pool():
    first = use.distributed()
    with pytest.raises(ValueError, match="bad input on rank 0") as info:
        fail_everywhere.distributed()
    assert info.value.rank == 0
    assert pids_of(use.distributed()) == pids_of(first)


def _assert_cold_after(first_pids, capsys, why: str):
    assert gone(first_pids), f"ranks of the torn-down pool survived: {alive(first_pids)}"
    again = use.distributed()
    assert [r[2] for r in again] == [3.0, 3.0]
    assert set(pids_of(again)).isdisjoint(first_pids)
    out = capsys.readouterr().out
    cold = [line for line in out.splitlines() if "starting a new pool (cold)" in line]
    assert len(cold) == 1 and why in cold[0], out


def test_a_crash_tears_the_pool_down(capsys):
    first = pids_of(use.distributed())
    with pytest.raises(gpulaunch.WorkerCrashError) as info:
        crash_rank1.distributed()
    assert info.value.rank == 1 and info.value.exit_code == 3
    _assert_cold_after(first, capsys, "rank 1 exited with code 3")


def test_one_rank_raising_while_its_peer_waits_tears_it_down(capsys):
    first = pids_of(use.distributed())
    with pytest.raises(KeyError, match="only rank 1") as info:
        raise_rank1_while_peer_waits.distributed()
    assert info.value.rank == 1
    _assert_cold_after(first, capsys, "rank 1 raised while its peers did not return")


def test_a_timeout_tears_the_pool_down(capsys):
    first = pids_of(use.distributed())
    with pytest.raises(gpulaunch.RunTimeoutError):
        sleep_long.with_overrides(timeout=3, shutdown_grace=1).distributed()
    _assert_cold_after(first, capsys, "timeout=")


def test_a_hang_tears_the_pool_down(capsys):
    first = pids_of(use.distributed())
    with pytest.raises(gpulaunch.HangError) as info:
        sleep_long.with_overrides(hang_timeout=2).distributed()
    assert "time.sleep(60)" in str(info.value)
    _assert_cold_after(first, capsys, "a hang")


def test_a_cancel_tears_the_pool_down(capsys):
    first = pids_of(use.distributed())
    handle = sleep_long.submit()
    deadline = time.monotonic() + 30
    while "sleeping" not in handle.logs(0) and time.monotonic() < deadline:
        time.sleep(0.05)
    handle.cancel()
    with pytest.raises(gpulaunch.RunCancelledError):
        handle.result()
    _assert_cold_after(first, capsys, "cancelled")


def test_other_settings_start_a_new_pool(capsys):
    first = pids_of(use.with_overrides(env={"POOL_TEST": "1"}).distributed())
    again = use.with_overrides(env={"POOL_TEST": "1"}).distributed()
    assert pids_of(again) == first
    other = use.with_overrides(env={"POOL_TEST": "2"}).distributed()
    assert set(pids_of(other)).isdisjoint(first)
    assert gone(first), "the old pool was not closed"
    out = capsys.readouterr().out
    assert "settings changed (env=)" in out, out


def test_a_changed_installed_distribution_makes_the_next_call_cold(tmp_path, monkeypatch,
                                                                   capsys):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    first = pids_of(use.distributed())
    assert pids_of(use.distributed()) == first
    (site / "newpkg-1.0.dist-info").mkdir()
    (site / "newpkg-1.0.dist-info" / "METADATA").write_text("Name: newpkg\nVersion: 1.0\n")
    again = pids_of(use.distributed())
    assert set(again).isdisjoint(first)
    assert "installed packages" in capsys.readouterr().out


def test_shutdown_leaves_no_process():
    first = pids_of(use.distributed())
    pool_dir = POOLS.pool.dir
    gpulaunch.shutdown()
    assert gone(first, wait=5), alive(first)
    assert not pool_dir.exists()


def test_the_cli_lists_and_closes_a_pool():
    from gpulaunch import cli
    first = pids_of(use.distributed())
    assert cli.main(["pool", "list"]) == 0
    assert cli.main(["pool", "close"]) == 0
    assert gone(first, wait=5), alive(first)
    again = use.distributed()                    # the owner notices and starts cold
    assert set(pids_of(again)).isdisjoint(first)


def test_doctor_and_pool_list_show_the_live_pool(capsys):
    from gpulaunch import cli
    pids = pids_of(use.distributed())
    pool_id = POOLS.pool.pool_id
    capsys.readouterr()
    assert cli.main(["doctor"]) == 0
    doctor = capsys.readouterr().out
    line = next(x for x in doctor.splitlines() if pool_id in x)
    assert "2 x cpu" in line and f"caller {os.getpid()}" in line and "calls 1" in line, doctor
    assert "warm pools  1" in doctor
    assert cli.main(["pool", "list"]) == 0
    listed = capsys.readouterr().out
    assert pool_id in listed and f"ranks {pids[0]},{pids[1]}" in listed, listed
    gpulaunch.shutdown()
    assert cli.main(["doctor"]) == 0
    assert "warm pools  none" in capsys.readouterr().out


def test_the_callers_sigkill_leaves_no_process(tmp_path):
    code = textwrap.dedent("""
        import os, sys, time
        from gpulaunch import distributed
        @distributed(gpus=2, keep_alive=300)
        def f():
            return os.getpid()
        print("PIDS", *f.distributed(), flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("PIDS"):
            line = proc.stdout.readline()
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and not gone(pids, wait=0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert gone(pids, wait=10), f"ranks outlived their caller: {alive(pids)}"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_keep_alive_values_and_refusals():
    from gpulaunch.options import LaunchOptions
    assert LaunchOptions(keep_alive=True).keep_alive == 900.0
    assert LaunchOptions(keep_alive=30).keep_alive == 30.0
    assert LaunchOptions().keep_alive is False
    for bad in ("yes", -1, 0, float("inf")):
        with pytest.raises(gpulaunch.ConfigurationError, match="keep_alive"):
            LaunchOptions(keep_alive=bad)
    # keep_alive with max_restarts restarts on new ranks: tests/pool/test_warm_like_cold.py

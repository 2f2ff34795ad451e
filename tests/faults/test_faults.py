"""Reliability (issue 3): every fault ends the run quickly, says what happened, leaves nothing.

Times are measured and bounded generously (60 s) only to catch a hang; the real figures are
measured by bench/reliability_matrix.py and written to docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time

import psutil
import pytest
from conftest import PY, alive, assert_no_survivors, latest_run_dir, python_env, run_pids

from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.common.rundir import RunDir, read_json
from gpulaunch.errors import (
    ConfigurationError,
    HangError,
    RunCancelledError,
    RunTimeoutError,
    WorkerCrashError,
)

BOUND_S = 60.0


def _faulty(mode: str):
    import ctypes
    import os
    import sys
    import time

    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)                       # everybody is up and connected
    if rt.get_global_rank() == 1:
        if mode == "exception":
            raise ValueError("rank one is unhappy")
        if mode == "sys_exit":
            sys.exit(3)
        if mode == "os_exit":
            os._exit(1)
        if mode == "segfault":
            ctypes.string_at(0)
        if mode == "memory_error":
            bytearray(1 << 60)               # a real allocation failure
        if mode == "sigkill":
            print("READY", flush=True)
            time.sleep(600)                  # the test kills us from outside
    dist.all_reduce(t)                       # the survivors are blocked here
    return t.item()


FAULTS = {
    "exception": (ValueError, ["rank one is unhappy", 'raise ValueError("rank one is unhappy")']),
    "sys_exit": (WorkerCrashError, ["Rank 1", "sys.exit(3)"]),
    "os_exit": (WorkerCrashError, ["Rank 1", "exited with code 1", "os._exit()"]),
    "segfault": (WorkerCrashError, ["Rank 1", "SIGSEGV", "Segmentation fault", "string_at"]),
    "memory_error": (MemoryError, []),
    "sigkill": (WorkerCrashError, ["Rank 1", "SIGKILL", "out-of-memory killer", "READY"]),
}


@pytest.mark.parametrize("mode", list(FAULTS))
def test_fault_stops_every_rank_and_names_the_root_cause(mode, gpulaunch_home):
    expected_type, fragments = FAULTS[mode]
    f = distributed(gpus=2)(_faulty)
    t0 = time.monotonic()
    handle = f.submit(mode)
    if mode == "sigkill":
        run = RunDir(handle.run_dir)
        deadline = time.monotonic() + BOUND_S
        while "READY" not in handle.logs(rank=1) and time.monotonic() < deadline:
            time.sleep(0.1)
        pid = read_json(run.rank_file(0, 1, "info.json"))["pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)          # from outside, like the OOM killer
    with pytest.raises(expected_type) as info:
        handle.result(timeout=BOUND_S)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND_S
    err = info.value
    text = str(err) + str(err.__cause__ or "")
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert getattr(err, "rank", None) == 1
    if isinstance(err, WorkerCrashError):
        assert err.exit_code == {"sys_exit": 3, "os_exit": 1, "segfault": -signal.SIGSEGV,
                                 "sigkill": -signal.SIGKILL}[mode]
    assert_no_survivors(handle.run_dir)


def test_timeout_stops_the_whole_tree_even_a_rank_that_ignores_sigterm(gpulaunch_home):
    @distributed(gpus=2, timeout=4, shutdown_grace=1)
    def stubborn():
        import signal
        import subprocess
        import sys
        import time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # a grandchild process too: it must die with its rank
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(600)

    t0 = time.monotonic()
    with pytest.raises(RunTimeoutError, match="timeout=4 s"):
        stubborn.distributed()
    assert time.monotonic() - t0 < BOUND_S
    run_dir = latest_run_dir(gpulaunch_home)
    assert_no_survivors(run_dir)
    grandchildren = [p for p in psutil.process_iter(["cmdline"])
                     if p.info["cmdline"] and "time.sleep(600)" in " ".join(p.info["cmdline"])
                     and p.pid not in run_pids(run_dir)]
    assert not [p.pid for p in grandchildren if p.status() != psutil.STATUS_ZOMBIE]


def test_hang_watchdog_reports_every_rank_stack(gpulaunch_home):
    @distributed(gpus=2, hang_timeout=10)
    def skips_a_collective():
        import time

        import torch
        import torch.distributed as dist
        rt.init()
        t = torch.ones(1)
        if rt.get_global_rank() == 1:
            time.sleep(3600)                      # rank 1 never joins the all_reduce
        dist.all_reduce(t)                        # rank 0 waits here forever
        return t.item()

    t0 = time.monotonic()
    with pytest.raises(HangError) as info:
        skips_a_collective.distributed()
    assert time.monotonic() - t0 < BOUND_S + 10
    err = info.value
    assert set(err.stacks) == {0, 1}
    assert "dist.all_reduce(t)" in err.stacks[0]         # the line rank 0 was waiting on
    assert "time.sleep(3600)" in err.stacks[1]           # and rank 1's
    assert "test_faults.py" in err.stacks[0]
    assert "made no progress for" in str(err)
    assert_no_survivors(latest_run_dir(gpulaunch_home))


def test_cancel_stops_every_rank_within_seconds(gpulaunch_home):
    @distributed(gpus=2)
    def forever():
        import time
        print("up", flush=True)
        time.sleep(600)

    h = forever.submit()
    deadline = time.monotonic() + BOUND_S
    while h.logs().count("up") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    t0 = time.monotonic()
    h.cancel()
    assert time.monotonic() - t0 < 15
    assert h.status == "CANCELLED"
    with pytest.raises(RunCancelledError):
        h.result()
    assert_no_survivors(h.run_dir)


CALLER = textwrap.dedent("""
    import sys, time
    from gpulaunch import distributed, runtime as rt

    @distributed(gpus=2)
    def forever():
        print("RANK-UP", flush=True)
        time.sleep(600)

    @distributed(gpus=2)
    def quick():
        return rt.get_global_rank()

    try:
        forever.distributed()
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        print("AGAIN", quick.distributed(), flush=True)   # the same process launches again
""")


def _start_caller(tmp_path, home):
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=python_env({"GPULAUNCH_HOME": str(home)}))
    seen = ""
    deadline = time.monotonic() + BOUND_S
    while seen.count("RANK-UP") < 2 and time.monotonic() < deadline:
        seen += proc.stdout.readline()
    assert seen.count("RANK-UP") == 2, seen
    return proc, seen


def test_keyboard_interrupt_stops_ranks_and_the_caller_can_launch_again(tmp_path, gpulaunch_home):
    proc, _ = _start_caller(tmp_path, gpulaunch_home)
    first_run = latest_run_dir(gpulaunch_home)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)                 # what a notebook's stop button does
    out, _ = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 0, out
    assert "INTERRUPTED" in out and "AGAIN [0, 1]" in out
    assert time.monotonic() - t0 < BOUND_S
    assert_no_survivors(first_run)


def test_killed_caller_takes_its_ranks_with_it(tmp_path, gpulaunch_home):
    proc, _ = _start_caller(tmp_path, gpulaunch_home)
    run_dir = latest_run_dir(gpulaunch_home)
    proc.kill()                                     # SIGKILL: no handler, no atexit runs
    proc.wait()
    assert_no_survivors(run_dir, wait=20)


def _train_with_checkpoints(ckpt_dir: str, steps: int, crash_at: int | None):
    """Deterministic DDP training that checkpoints every step and resumes from the latest."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rt.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(ckpt_dir, "latest.pt")
    start = 0
    if os.path.exists(path):                       # the resume pattern (docs/reliability.md)
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, steps):
        if crash_at is not None and step == crash_at and rt.get_restart_count() == 0 \
                and rt.get_global_rank() == 1:
            os.kill(os.getpid(), 9)               # die mid-training, like an OOM kill
        g = torch.Generator().manual_seed(1000 * step + rt.get_global_rank())
        x = torch.randn(32, 8, generator=g)
        loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rt.is_main():                           # atomic publish: write then rename
            tmp = path + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, path)
        dist.barrier()
    return {"restarts": rt.get_restart_count(), "start": start,
            "weights": [p.detach().clone() for p in model.module.parameters()]}


@pytest.mark.slow
def test_restart_after_sigkill_resumes_from_checkpoint_with_identical_weights(tmp_path):
    import torch
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    clean = distributed(gpus=2)(_train_with_checkpoints).distributed(str(tmp_path / "a"), 12, None)
    crashed = distributed(gpus=2, max_restarts=1)(_train_with_checkpoints).distributed(
        str(tmp_path / "b"), 12, 6)
    assert crashed[0]["restarts"] == 1 and crashed[0]["start"] == 6
    assert clean[0]["restarts"] == 0 and clean[0]["start"] == 0
    for a, b in zip(clean[0]["weights"], crashed[0]["weights"]):
        assert torch.equal(a, b)


def test_restarts_give_up_after_the_budget(gpulaunch_home):
    @distributed(gpus=2, max_restarts=2)
    def always_fails():
        raise RuntimeError(f"attempt {rt.get_restart_count()} failed")

    with pytest.raises(RuntimeError, match="attempt 2 failed") as info:
        always_fails.distributed()
    run = RunDir(latest_run_dir(gpulaunch_home))
    assert run.attempts() == [0, 1, 2]
    # one error, naming every earlier attempt's root cause (read from its attempt<k>/ folder)
    history = info.value.restart_history
    assert len(history) == 2, history
    for k, line in enumerate(history):
        assert re.fullmatch(rf"attempt {k}: rank [01]: RuntimeError: attempt {k} failed", line)
        assert line in str(info.value.__cause__)


def test_bad_settings_are_refused_with_the_fix():
    for kw, pattern in [({"timeout": -1}, "timeout must be a positive number"),
                        ({"hang_timeout": 0}, "hang_timeout must be a positive number"),
                        ({"max_restarts": -1}, "max_restarts must be an int >= 0"),
                        ({"stream_logs": "some"}, "stream_logs must be"),
                        ({"env": {"A": 1}}, "env must be a dict of str")]:
        with pytest.raises(ConfigurationError, match=pattern):
            distributed(gpus=2, **kw)(lambda: 1)


@pytest.mark.slow
def test_fifty_launches_leave_no_processes_ports_or_file_descriptors(gpulaunch_home):
    me = psutil.Process()
    f = distributed(gpus=2, stream_logs="none")(lambda: rt.get_global_rank())
    f.distributed()                                 # warm-up: lazy imports open their files
    fds0 = me.num_fds()
    children0 = {p.pid for p in me.children(recursive=True)}
    for _ in range(50):
        assert f.distributed() == [0, 1]
    assert me.num_fds() <= fds0, (fds0, me.num_fds())
    # the one standby agent for the next launch (standby.py) is the only child allowed
    from gpulaunch.backends.local.standby import STANDBY
    leftover = {p.pid for p in me.children(recursive=True)} - children0 - {STANDBY.pid()}
    assert not alive(leftover)
    runs = sorted((gpulaunch_home / "runs").iterdir())
    assert len(runs) == 51
    for run_dir in runs[-5:]:
        assert_no_survivors(run_dir)
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in
                 {pid for d in runs for pid in run_pids(d)}]
    assert not listening

"""A pool rank: ``python -u -m gpulaunch.rank.pool_worker`` (started by ``backends.local.pool_ranks``).

Unlike ``worker.py`` (one call, then ``os._exit``), this process serves call after call of a warm
pool (``keep_alive=``), so a later call pays no process start, no ``import torch``, no CUDA
context and no NCCL communicator set-up:

    start:     import torch; read requests from stdin (one JSON line per call)
    each call: {"run_dir", "attempt", "env"} -> output to that run's attempt<k>/rank<r>.log,
               then the rank body (``body.py``, the one a cold rank runs: info, stacks,
               watchdog, result or error, post-mortem, pdb with ``debug=True``), then "done"
               on the reply pipe, then (once idle) gc + ``empty_cache()``
    end:       stdin EOF or the caller's pid gone -> kill our own process group at once

The process group is created by the first call's function (``rt.init()``, as in a cold run) and
kept: while we serve, ``init_process_group`` on an existing group and ``destroy_process_group``
are no-ops, so a function written for a cold run (init at the top, destroy at the end) runs
unchanged call after call. ``gpulaunch.runtime.state`` is a module global: it lives as long as
this process, which is what makes it persist across the calls of one pool.

A Python exception leaves this process serving; a crash, a signal or the caller's teardown
(timeout, hang, cancel) ends it, and the caller starts the next call cold.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import queue
import signal
import sys
import threading

from ..common import private
from ..common.payload import load_call
from ..common.rundir import RunDir, hostname
from . import body
from . import state as rank_state

REPLY_FD_ENV = "GPULAUNCH_POOL_REPLY_FD"
TIDY_AFTER_S = 0.05      # idle this long after a call: gc + empty_cache
# The identity of this rank: kept when a call's environment is applied.
IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "CUDA_VISIBLE_DEVICES", REPLY_FD_ENV,
            "TORCHELASTIC_RESTART_COUNT")


def _kill_self() -> None:
    """The caller is gone: this rank (and anything it started) must not outlive it."""
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(1)


def _read_requests(requests: queue.Queue, caller_pid: int) -> None:
    """Requests arrive on stdin; EOF, or a parent that is no longer the caller, ends us. A
    thread, so that the end is seen while the main thread is inside the user's function."""
    import selectors
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(0, selectors.EVENT_READ)
        while True:
            if os.getppid() != caller_pid:
                _kill_self()
            if not sel.select(1.0):
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                _kill_self()
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                requests.put(json.loads(line))


def _keep_group_across_calls() -> None:
    """Make re-initialising and destroying the default group no-ops while the pool serves."""
    import torch.distributed as dist
    if not dist.is_available():
        return
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_once(*args, **kwargs):
        if dist.is_initialized():
            return None
        return init(*args, **kwargs)

    def keep(group=None):
        if group is not None:       # a subgroup the function made: really destroy it
            return destroy(group)
        return None

    init_once.__wrapped__, keep.__wrapped__ = init, destroy
    dist.init_process_group, dist.destroy_process_group = init_once, keep


def _apply_env(env: dict[str, str]) -> None:
    keep = {k: os.environ[k] for k in IDENTITY if k in os.environ}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(keep)


def serve_call(request: dict, rank: int, host: str) -> str:
    """Run one call in its run directory through the rank body (``body.py``), exactly as a
    cold rank runs it; only the output redirection is ours (the process outlives the call)."""
    run = RunDir(request["run_dir"])
    attempt = int(request.get("attempt", 0))
    _apply_env(request.get("env") or {})
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    if request.get("cwd"):
        os.chdir(request["cwd"])     # a previous call's os.chdir must not leak into this one
    private.mkdir(run.attempt_dir(attempt))
    log = os.open(run.rank_file(attempt, rank, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                  0o600)
    saved = os.dup(1)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    dropped = request.get("dropped")
    if dropped:                      # a new pool after one that ended: its rt.state is gone
        rank_state.RANK_STATE.mark_dropped(dropped.get("keys") or {}, dropped.get("why", ""))
    files = body.RankFiles(run, attempt, rank, host)
    try:
        body.run_call(files, host, lambda: _load_and_call(run, attempt, rank))
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os.dup2(saved, 1)
        os.dup2(saved, 2)
        os.close(saved)
        files.close()
    try:
        return run.launch().label
    except Exception:  # noqa: BLE001 - an unreadable record: the call is named by its run
        return run.run_id


def _load_and_call(run: RunDir, attempt: int, rank: int):
    func, args, kwargs = load_call(run.payload)
    run.mark_loaded(attempt, rank)
    return func(*args, **kwargs)


def _tidy() -> None:
    """Between calls: drop the last call's garbage and hand cached-but-free GPU memory back."""
    gc.collect()
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    reply = int(os.environ[REPLY_FD_ENV])
    caller_pid = int(os.environ.get("GPULAUNCH_POOL_CALLER_PID") or os.getppid())
    os.dup2(1, 2)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    requests: queue.Queue = queue.Queue()
    threading.Thread(target=_read_requests, args=(requests, caller_pid), daemon=True,
                     name="gpulaunch-pool-requests").start()
    import torch  # noqa: F401 - paid once per pool, here, before the first request is read
    _keep_group_across_calls()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    host = hostname()
    os.write(reply, b"ready\n")
    pending = None
    owners: dict[str, str] = {}
    while True:
        request = pending if pending is not None else requests.get()
        pending = None
        label = serve_call(request, rank, host)
        # which call set each rt.state key: told to the caller, so that the ranks of a pool
        # started after this one ends can name the call to re-run (StateDroppedError)
        owners = rank_state.owners(owners, f"{label}.distributed(...)")
        # "done" first, then tidy only once no call is waiting: gc of a process with torch
        # imported takes 0.1-0.3 s on a busy 2-core machine, which would otherwise delay a
        # call that comes right after this one (Python's own gc thresholds still apply).
        os.write(reply, f"done {request.get('seq', 0)} {json.dumps(owners)}\n".encode())
        try:
            pending = requests.get(timeout=TIDY_AFTER_S)
        except queue.Empty:
            _tidy()

if __name__ == "__main__":
    main()

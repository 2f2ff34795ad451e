"""The entry point of a cold rank: ``python -m gpulaunch.rank.worker RUN_DIR``.

It loads the function and arguments (or a script, a module, a command) and runs them through
the rank body (``body.py``, shared with the warm pool's ``pool_worker.py``), which writes the
return value or the exception (with its full traceback) into the run directory. It knows
nothing about which backend started it: all it reads is the torchrun environment (RANK,
LOCAL_RANK, ...) and GPULAUNCH_* variables.

It also installs the rank's safety nets before any user code runs:
  * the parent-death signal, so a rank never outlives its agent;
  * faulthandler, so a segfault prints the Python stack into the rank's log, and SIGUSR1 dumps
    every thread's stack into ``rank<r>.stacks`` (used by the hang watchdog);
  * the stall watchdog when ``hang_timeout`` is set.

And it ends with ``os._exit`` after flushing and running atexit handlers, so a rank that
finished can never hang at interpreter shutdown (a stray non-daemon thread, a process-group
destructor racing its peers).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import traceback

from ..common import constants, procutil
from ..common.redact import ENTRY_ARGV_ENV
from ..common.rundir import RunDir, hostname
from . import body


def _shutdown_process_group() -> None:
    # An asynchronous checkpoint still being written needs the process group: let it land.
    saver = sys.modules.get("gpulaunch.parallel._async_save")
    if saver is not None:
        saver._wait_at_exit()
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _teardown_bound() -> float:
    raw = os.environ.get("GPULAUNCH_TEARDOWN_TIMEOUT", "").strip()
    try:
        return float(raw) if raw else constants.TEARDOWN_TIMEOUT_S
    except ValueError:
        return constants.TEARDOWN_TIMEOUT_S


def _arm_teardown_bound(code: int) -> None:
    """The result (or error) is on disk: what follows (process-group destroy, the user's atexit
    handlers, a tracker flushing to a dead server) may take at most GPULAUNCH_TEARDOWN_TIMEOUT
    seconds, then the rank exits anyway. A thread, not an alarm: a signal handler never runs
    while the main thread is stuck inside C code."""
    import threading
    bound = _teardown_bound()
    if bound <= 0:
        return

    def cut():
        try:
            os.write(2, (f"gpulaunch: rank teardown (process group, atexit handlers) took over "
                         f"{bound:g} s after the result was written; exiting "
                         "(GPULAUNCH_TEARDOWN_TIMEOUT)\n").encode())
        finally:
            os._exit(code)

    timer = threading.Timer(bound, cut)
    timer.daemon = True
    timer.start()


def _finish(code: int) -> None:
    _arm_teardown_bound(code)
    _shutdown_process_group()
    try:
        atexit._run_exitfuncs()
    except Exception:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def fork_entry(run_dir: str) -> None:
    """The rank's entry when the agent FORKS it (``start_method="fork"``, the default on Linux).

    A forked rank inherits the agent's imported torch, which is what makes fork fast (a spawned
    rank pays ``import torch`` again: 1.5 s on an idle laptop, 4.5 s on the GPU machine). It
    also inherits agent state a fresh interpreter would not have; undo that here so that user
    code sees what a spawned rank sees.
    """
    import io
    import logging

    _wait_at_fork_gate()
    os.setsid()  # its own session and process group, as torchelastic's Popen gives a spawned rank
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # the agent's handlers raise SignalException
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the agent's exit handlers are not the rank's
    root = logging.getLogger()
    for h in list(root.handlers):  # the agent's basicConfig would swallow the user's
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic", "gpulaunch.agent"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    # What -u gives a spawned rank: unbuffered stdout/stderr, so the caller streams lines live.
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                  encoding=getattr(sys, name).encoding,
                                  errors=getattr(sys, name).errors)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS")
    if torch is not None and threads and threads.isdigit():
        # OpenMP read the variable when the agent imported torch, before the agent set it.
        torch.set_num_threads(int(threads))
    sys.argv = [__file__, run_dir]
    main([run_dir])


def _wait_at_fork_gate() -> None:
    """Do nothing until the agent has forked every rank (it closes the pipe's write end then;
    see ``ElasticAgent._fork_workers_behind_a_gate`` for the deadlock this prevents)."""
    gate = os.environ.pop(constants.FORK_GATE_ENV, None)
    if not gate:
        return
    read_end, write_end = (int(x) for x in gate.split(","))
    os.close(write_end)                  # our inherited copy: EOF needs every copy closed
    try:
        while os.read(read_end, 1):
            pass
    finally:
        os.close(read_end)


def main(argv: list[str]) -> None:
    run = RunDir(argv[0])
    parent = os.getppid()
    procutil.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before we armed the signal
        os._exit(1)
    os.dup2(1, 2)  # one ordered log per rank: stderr joins stdout's file

    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    host = hostname()
    for suffix in ("log", "stderr.log"):   # opened for us by torchelastic, with umask modes
        try:
            os.chmod(run.rank_file(attempt, rank, suffix), 0o600)
        except OSError:
            pass
    faulthandler.enable(file=sys.stderr, all_threads=True)
    files = body.RankFiles(run, attempt, rank, host,
                           node_rank=int(os.environ.get("NODE_RANK", "0")))
    try:
        kind = run.launch().entry.kind
    except Exception:  # noqa: BLE001 - _entry reports an unreadable record
        kind = "function"
    _finish(body.run_call(files, host, lambda: _entry(run, attempt, rank)(), kind=kind))


def _entry(run: RunDir, attempt: int = 0, rank: int = 0):
    """What this rank runs: the shipped function, a script, a module, or any command."""
    entry = run.launch().entry
    kind = entry.kind
    if kind == "function":
        from ..common.payload import load_call
        func, args, kwargs = load_call(run.payload)
        run.mark_loaded(attempt, rank)   # the file is closed: the agent may delete it now
        return lambda: func(*args, **kwargs)
    import runpy
    real = os.environ.pop(ENTRY_ARGV_ENV, None)   # launch.json holds the masked argv
    argv = json.loads(real) if real else list(entry.argv)
    if kind == "script":
        def run_script():
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")  # __file__ absolute
        return run_script
    if kind == "module":
        def run_module():
            sys.argv = argv
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        return run_module
    if kind == "exec":
        def run_exec():
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.execvp(argv[0], argv)  # keeps the pid and the parent-death signal
        return run_exec
    raise ValueError(f"unknown entry kind {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

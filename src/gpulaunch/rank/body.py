"""The rank body: what every rank does around the user's code, the same for a cold call
(``worker.py``: one call, then ``os._exit``) and a warm one (``pool_worker.py``: call after call
in a process that stays up). The two entry points differ only in how long the process lives.

    RankFiles(run, attempt, rank)   SIGUSR1 -> every thread's stack into rank<r>.stacks;
                                    rank<r>.info.json; the stall watchdog (hang_timeout)
    run_call(...)                   the user's code; its return value into rank<r>.result.pkl,
                                    or its exception (traceback, the failing frame's locals,
                                    CUDA memory on an OOM) into rank<r>.error.pkl; with
                                    ``debug=True`` pdb served at the raising frame first

A function that calls ``sys.exit(0)`` did not return: a failure that says so (a script's
``sys.exit(0)`` is its success). Returns the exit code the rank reports (0: a result).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from ..common.payload import exception_record
from ..common.records import RankInfo
from ..common.rundir import RunDir, write_json_atomic
from . import results, torchrun_env

COLLATERAL_PATTERNS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe",
    "NCCL communicator was aborted", "ProcessGroupNCCL is aborted", "DistNetworkError",
    "recvValue failed", "Socket Timeout", "Connection refused",
)
# gpulaunch's own frames above the user's code, left out of the traceback a user reads
_OWN_FILES = {__file__, str(Path(__file__).with_name("worker.py")),
              str(Path(__file__).with_name("pool_worker.py"))}


class RankFiles:
    """A rank's files for one call and the watchers that write them: stack dumps on SIGUSR1,
    ``info.json`` (pid, host, start), and the stall watchdog when ``GPULAUNCH_HANG_TIMEOUT``
    is set (read per call: a warm pool's next call may set another)."""

    def __init__(self, run: RunDir, attempt: int, rank: int, host: str, *, node_rank: int = 0):
        self.run, self.attempt, self.rank = run, attempt, rank
        torchrun_env.apply(run, attempt, rank)   # own torch seed, stderr marked, error file, title
        self.stacks = open(os.open(run.rank_file(attempt, rank, "stacks"),
                                   os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")
        faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True)
        write_json_atomic(run.rank_file(attempt, rank, "info.json"), RankInfo(
            rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")), pid=os.getpid(),
            host=host, attempt=attempt, started=time.time(), node_rank=node_rank).to_data())
        self.watchdog = None
        hang_timeout = float(os.environ.get("GPULAUNCH_HANG_TIMEOUT") or 0)
        if hang_timeout > 0:
            from .watchdog import StallWatchdog
            self.watchdog = StallWatchdog(hang_timeout, run.attempt_dir(attempt), rank)
            self.watchdog.start()

    def stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def close(self) -> None:
        """The call is over and the process goes on (a warm pool): stacks to stderr again."""
        self.stop_watchdog()
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        self.stacks.close()


def run_call(files: RankFiles, host: str, call: Callable[[], object], *,
             kind: str = "function") -> int:
    """Run ``call`` and record what it did (result or error) in the run directory; the exit
    code the rank reports: 0 when a result was written."""
    run, attempt, rank = files.run, files.attempt, files.rank
    try:
        result = call()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code == 0 and kind != "function":
            result = None        # a script's sys.exit(0) is its success
        else:
            # a function that calls sys.exit(0) did not return: a failure that says so
            caught = time.time()
            tb = user_traceback(e)
            sys.stderr.write(tb)
            _record(run, attempt, rank, exception_record(e, rank=rank, host=host, tb=tb,
                                                         exit_code=code, time=caught), e, tb)
            files.stop_watchdog()
            return code or 1
    except BaseException as e:  # noqa: BLE001 - everything must be reported
        caught = time.time()      # stamped before the slow work (traceback, memory, pickling)
        tb = user_traceback(e)
        sys.stderr.write(tb)
        from . import debugger, postmortem
        local_vars = postmortem.save(e, run.rank_file(attempt, rank, "locals.json"))
        extra = "\n".join(x for x in (cuda_memory_report(e), local_vars) if x)
        record = exception_record(e, rank=rank, host=host, tb=tb, time=caught, extra=extra,
                                  collateral=any(p in safe_str(e) for p in COLLATERAL_PATTERNS))
        if not isinstance(e, Exception):
            # KeyboardInterrupt, GeneratorExit...: the RANK's, never re-raised in the caller as
            # if the caller itself had been interrupted; it gets a RemoteError naming the rank
            record = dataclasses.replace(record, exception=None)
        _record(run, attempt, rank, record, e, tb)
        if debugger.enabled():    # the rank stays alive (its error recorded) while debugged
            debugger.serve(e.__traceback__, run.rank_file(attempt, rank, "debug.json"),
                           rank=rank, attach_hint=f"gpulaunch debug {run.run_id} --rank {rank}")
        files.stop_watchdog()
        return 1
    files.stop_watchdog()
    try:
        # Tensors go to the CPU here, in the rank: the caller must never need CUDA (or the
        # rank's device) to read a result; written straight to the file, not built in memory.
        results.write(run.rank_file(attempt, rank, "result.pkl"), result)
    except Exception as e:  # noqa: BLE001 - an unpicklable return value is this rank's failure
        err = results.unpicklable_error(rank, result, e)
        tb = "".join(traceback.format_exception(type(err), err, None))
        sys.stderr.write(tb)
        _record(run, attempt, rank, exception_record(err, rank=rank, host=host, tb=tb,
                                                     time=time.time()), err, tb)
        return 1
    return 0


def _record(run: RunDir, attempt: int, rank: int, record, exc: BaseException, tb: str) -> None:
    write_bytes_atomic(run.rank_file(attempt, rank, "error.pkl"), pickle_bytes(record))
    _write_elastic_error_file(exc, tb)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_elastic_error_file(exc: BaseException, tb: str) -> None:
    """torchelastic's own error-file format, so its ProcessFailure shows message and time
    (a cold rank only: torchelastic sets the variable)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(exc).__name__}: {safe_str(exc)}",
                        "extraInfo": {"py_callstack": tb, "timestamp": str(int(time.time()))}}}
    try:
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def cuda_memory_report(exc: BaseException) -> str:
    torch = sys.modules.get("torch")
    if torch is None or "out of memory" not in safe_str(exc).lower():
        return ""
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return "CUDA memory summary at the time of the error:\n" + torch.cuda.memory_summary()
    except Exception:  # noqa: BLE001
        pass
    return ""


def user_traceback(exc: BaseException) -> str:
    """The traceback without gpulaunch's own frames above the user's code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001
        return ""


def pickle_bytes(obj) -> bytes:
    import pickle
    return pickle.dumps(obj, protocol=5)

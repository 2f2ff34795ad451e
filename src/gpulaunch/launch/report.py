"""Turn a finished run directory into the caller's outcome: the list of results, or one error.

The error names the root cause: the rank that failed first for a reason of its own. A rank that
only failed because a peer vanished under it (gloo "Connection closed by peer", an aborted NCCL
communicator) is a consequence, never the cause, unless nothing else failed.
"""

from __future__ import annotations

import linecache
import os
import pickle
import re
import signal
from pathlib import Path

from .. import errors
from .logstream import tail_text
from .procutil import describe_exit
from .rundir import RunDir, read_json

LOG_TAIL_LINES = 30


def oom_kill_count() -> int | None:
    """The cgroup's OOM-kill counter (cgroup v2), to confirm that a SIGKILL was the OOM killer."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory.events.local"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return None


def _load_record(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError):
        return None


def _rank_log(run: RunDir, attempt: int, rank: int, lines: int = LOG_TAIL_LINES) -> str:
    text = _last_lines(_without_launcher_frames(tail_text(run.rank_file(attempt, rank, "log"),
                                                          lines * 10)), lines)
    early = tail_text(run.rank_file(attempt, rank, "stderr.log"), lines)
    return (early + "\n" + text).strip() if early else text


def _last_lines(text: str, n: int) -> str:
    return "\n".join(text.splitlines()[-n:])


_WORKER_PY = os.path.join("gpulaunch", "launch", "worker.py")


def _without_launcher_frames(text: str) -> str:
    """Drop, from faulthandler dumps (``File "x.py", line 12 in f``, most recent call first),
    the frames from gpulaunch's worker entry down: they are the launcher's, not the user's (a
    forked rank's stack goes on through multiprocessing and the agent), and they would push
    the user's own frames out of the log tail we show."""
    out, skipping = [], False
    for line in text.splitlines():
        m = re.match(r'\s*File "(.+)", line \d+ in ', line)
        if m is None:
            skipping = False
        elif skipping or m.group(1).endswith(_WORKER_PY):
            skipping = True
            continue
        out.append(line)
    return "\n".join(out)


def _indent(text: str, pad: str = "    ") -> str:
    return "\n".join(pad + line for line in text.splitlines())


def annotate_stack(text: str) -> str:
    """Add the source line under each faulthandler frame ('File "x.py", line 12 in f')."""
    out = []
    for line in text.splitlines():
        out.append(line)
        m = re.match(r'\s*File "(.+)", line (\d+) in ', line)
        if m:
            src = linecache.getline(m.group(1), int(m.group(2))).strip()
            if src:
                out.append(f"      {src}")
    return "\n".join(out)


class Failure:
    """One rank's failure in the final attempt, with what we know about it."""

    def __init__(self, rank: int, exit_code: int | None, record: dict | None, host: str):
        self.rank = rank
        self.exit_code = exit_code
        self.record = record
        self.host = host

    @property
    def priority(self) -> int:
        if self.record is None:
            return 1                              # crashed without a Python exception
        return 2 if self.record.get("collateral") else 0

    @property
    def time(self) -> float:
        return (self.record or {}).get("time", float("inf"))

    def summary(self) -> str:
        if self.record:
            message = (self.record["message"].splitlines() or [""])[0]
            if len(message) > 160:
                message = message[:160] + "..."
            return f"rank {self.rank}: {self.record['type'].rsplit('.', 1)[-1]}: {message}"
        return f"rank {self.rank} {describe_exit(self.exit_code)}"


def _root_cause(failures: list[Failure]) -> Failure:
    best = min(failures, key=lambda f: (f.priority, f.time, f.rank))
    # Ranks that raise the same error at nearly the same moment: report the lowest rank.
    near = [f for f in failures if f.priority == best.priority and f.time - best.time < 0.5
            and (f.record or {}).get("type") == (best.record or {}).get("type")]
    return min(near, key=lambda f: f.rank) if near else best


def _signal_hint(exit_code: int, oom_confirmed: bool) -> str:
    sig = -exit_code
    if sig == signal.SIGKILL:
        if oom_confirmed:
            return ("The kernel's out-of-memory killer killed it (the cgroup's oom_kill counter "
                    "went up during the run): the ranks together needed more host RAM than this "
                    "machine or container allows. Load less per rank, use fewer ranks, or shard "
                    "the model (FSDP/ZeRO) instead of replicating it.")
        return ("SIGKILL is what the host's out-of-memory killer sends (check `dmesg` or the "
                "container's memory limit); it is also what `kill -9` sends.")
    if sig == signal.SIGSEGV:
        return ("A segmentation fault in native code (a C/C++/CUDA extension). The Python stack "
                "at the crash, printed by faulthandler, is in the log below.")
    if sig == signal.SIGABRT:
        return "The process aborted (a failed C++ assertion or an uncaught C++ exception)."
    if sig == signal.SIGBUS:
        return "SIGBUS: often an undersized /dev/shm (DataLoader workers in a container)."
    return ""


def raise_for_run(run: RunDir, *, reason: str | None = None, timeout: float | None = None,
                  world_size: int, oom_kills_at_start: int | None = None) -> list:
    """Return the per-rank results of a finished run, or raise the error that explains it."""
    status = run.status()
    attempts = run.attempts()
    attempt = status.get("attempt", attempts[-1] if attempts else 0)
    run_dir = str(run.path)

    if reason == "timeout":
        raise errors.RunTimeoutError(
            f"The run exceeded timeout={timeout:g} s and was stopped (every rank got SIGTERM, then "
            f"SIGKILL). Raise timeout= (or pass timeout=None) if it needs longer.\n"
            f"Last lines of rank 0:\n{_indent(_rank_log(run, attempt, 0, 15))}\nRun directory: {run_dir}",
            rank=None, run_dir=run_dir, log_tail=_rank_log(run, attempt, 0))
    if reason == "cancelled":
        raise errors.RunCancelledError(f"The run was cancelled; every rank was stopped. "
                                       f"Run directory: {run_dir}", run_dir=run_dir)

    hang = read_json(run.hang_json)
    if hang:
        stacks = {}
        for r in range(world_size):
            text = ""
            try:
                text = run.rank_file(attempt, r, "stacks").read_text()
            except OSError:
                pass
            info = read_json(run.rank_file(attempt, r, "info.json"), {})
            if not text.strip():
                done = run.rank_file(attempt, r, "result.pkl").exists()
                text = "(already finished: its function had returned)" if done else \
                    "(no stack: the rank had already exited)"
            stacks[r] = annotate_stack(text.strip()) if info else text
        where = hang.get("where") or ""
        body = "\n".join(f"--- rank {r} ---\n{_indent(s)}" for r, s in stacks.items())
        raise errors.HangError(
            f"Hang detected: rank {hang.get('detected_by')} made no progress for "
            f"{hang.get('stuck_for')} s (hang_timeout). It was waiting at:\n{_indent(where.rstrip())}\n"
            f"Every rank was stopped. Python stacks of all ranks at that moment:\n{body}\n"
            f"Run directory: {run_dir}",
            rank=hang.get("detected_by"), stacks=stacks, run_dir=run_dir)

    state = status.get("state")
    if state == "SUCCEEDED":
        results = []
        for r in range(world_size):
            path = run.rank_file(attempt, r, "result.pkl")
            if not path.exists():
                results.append(None)      # a script or command entry point returns nothing
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results

    if state == "FAILED":
        failures = []
        for r_str, f in (status.get("failures") or {}).items():
            r = int(r_str)
            info = read_json(run.rank_file(attempt, r, "info.json"), {})
            failures.append(Failure(r, f.get("exitcode"),
                                    _load_record(run.rank_file(attempt, r, "error.pkl")),
                                    info.get("host", "?")))
        if not failures:
            raise errors.LaunchError(f"The run failed but no rank reported a failure. "
                                     f"Run directory: {run_dir}", run_dir=run_dir)
        root = _root_cause(failures)
        others = [f.summary() for f in failures if f is not root]
        also = ("\nAlso failed (after the root cause): " + "; ".join(others)) if others else ""
        log_tail = _rank_log(run, attempt, root.rank) or "(it printed nothing)"
        where = f"rank {root.rank} (host {root.host}, attempt {attempt})"
        rec = root.record
        if rec and rec.get("exception") is not None and not rec["type"].endswith("SystemExit"):
            try:
                exc = pickle.loads(rec["exception"])
            except Exception:
                exc = None
            if isinstance(exc, BaseException):
                cause = errors.RemoteTraceback(
                    f"\n\nTraceback from {where}:\n{rec['traceback'].rstrip()}{also}")
                exc.__cause__ = cause
                for attr, value in (("rank", root.rank), ("host", root.host),
                                    ("run_dir", run_dir), ("remote_traceback", rec["traceback"])):
                    try:
                        setattr(exc, attr, value)
                    except Exception:
                        pass
                raise exc
        if rec and rec["type"].endswith("SystemExit"):
            code = rec.get("exit_code", root.exit_code)
            raise errors.WorkerCrashError(
                f"Rank {root.rank} (host {root.host}) called sys.exit({code}).{also}\n"
                f"{rec['traceback'].rstrip()}\nRun directory: {run_dir}",
                rank=root.rank, host=root.host, exit_code=code, log_tail=log_tail, run_dir=run_dir)
        if rec:
            raise errors.RemoteError(
                f"Rank {root.rank} (host {root.host}) raised {rec['type']}: {rec['message']}\n"
                f"(the exception object could not be rebuilt here){also}\n{rec['traceback']}",
                remote_type=rec["type"], remote_traceback=rec["traceback"], rank=root.rank,
                host=root.host, exit_code=root.exit_code, log_tail=log_tail, run_dir=run_dir)
        code = root.exit_code
        oom_now = oom_kill_count()
        oom = (oom_now is not None and oom_kills_at_start is not None
               and oom_now > oom_kills_at_start)
        if code is not None and code < 0:
            hint = _signal_hint(code, oom)
            what = f"was killed by {describe_exit(code).split('by ')[-1]}"
        else:
            kind = (run.launch().get("entry") or {}).get("kind", "function")
            hint = ("It ended without raising a Python exception: os._exit(), or a native "
                    "library that called exit().") if kind == "function" else ""
            what = describe_exit(code)
        raise errors.WorkerCrashError(
            f"Rank {root.rank} (host {root.host}) {what}. {hint}{also}\n"
            f"Last lines of rank {root.rank}:\n{_indent(log_tail)}\nRun directory: {run_dir}",
            rank=root.rank, host=root.host, exit_code=code, log_tail=log_tail, run_dir=run_dir)

    if state == "AGENT_ERROR":
        raise errors.LaunchError(f"gpulaunch's agent failed: {status.get('error')}\n"
                                 f"{status.get('traceback', '')}Run directory: {run_dir}",
                                 run_dir=run_dir)
    agent_tail = tail_text(run.agent_log, 30)
    raise errors.LaunchError(
        f"The run ended in state {state or 'unknown'} without a result (the agent process "
        f"stopped unexpectedly).\nAgent output:\n{_indent(agent_tail)}\nRun directory: {run_dir}",
        run_dir=run_dir)

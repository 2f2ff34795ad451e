"""Read a finished run's directory into a typed ``RunOutcome`` (the rules are in ``outcome``).

Both backends end here: a local run's directory is written by its agent and ranks; a Ray run's
is the caller's mirror of every node's files. What differs (the node states, a lost node) comes
in as arguments.
"""

from __future__ import annotations

import json
import linecache
import os
import pickle
import re
import warnings
from pathlib import Path

from .. import errors
from ..common import constants
from ..common.records import RankError, RankExit, RunState, StopReason
from ..common.rundir import RunDir
from .logstream import tail_text
from .outcome import HangReport, LostNode, RankFailure, RunOutcome, root_cause

LOG_TAIL_LINES = 30
_WORKER_PY = os.path.join("gpulaunch", "rank", "worker.py")


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


def without_launcher_frames(text: str) -> str:
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


def rank_log(run: RunDir, attempt: int, rank: int, lines: int = LOG_TAIL_LINES) -> str:
    text = "\n".join(without_launcher_frames(
        tail_text(run.rank_file(attempt, rank, "log"), lines * 10)).splitlines()[-lines:])
    early = tail_text(run.rank_file(attempt, rank, "stderr.log"), lines)
    return (early + "\n" + text).strip() if early else text


def _load_error(path: Path) -> RankError | None:
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None
    if isinstance(data, RankError):
        return data
    return RankError(**data) if isinstance(data, dict) else None


def rank_error(run: RunDir, attempt: int, rank: int) -> RankError | None:
    """The exception rank ``rank`` recorded in attempt ``attempt`` (its error.pkl), if any."""
    return _load_error(run.rank_file(attempt, rank, "error.pkl"))


def elastic_error(path: Path) -> str | None:
    """The failure a program left in its torchelastic error file (``@record`` writes it to
    TORCHELASTIC_ERROR_FILE): read when a rank has no error.pkl (a command run with
    --no-python, whose Python gpulaunch does not wrap)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        stack = (message.get("extraInfo") or {}).get("py_callstack") or ""
        message = f"{message.get('message') or ''}\n{stack}".strip()
    return f"torchelastic error file {path}:\n{message}" if message else None


def rank_failures(run: RunDir, attempt: int, exits: dict[int, RankExit]) -> tuple:
    out = []
    for rank, ex in sorted(exits.items()):
        info = run.rank_info(attempt, rank)
        error = _load_error(run.rank_file(attempt, rank, "error.pkl"))
        log = rank_log(run, attempt, rank)
        elastic = None if error else elastic_error(run.rank_file(attempt, rank, "error.json"))
        out.append(RankFailure(rank, ex.exitcode, error, info.host if info else "?",
                               f"{log}\n{elastic}".strip() if elastic else log))
    return tuple(out)


def attempt_causes(run: RunDir, history) -> tuple[str, ...]:
    """Each failed attempt of a run with restarts (``AttemptRecord``s), as "attempt k: <root
    cause>": the cause the caller recorded, else the root cause among the attempt's failed
    ranks, read from that attempt's folder."""
    out = []
    for a in history:
        cause = a.cause
        if not cause:
            failures = rank_failures(run, a.attempt, a.failures)
            cause = root_cause(failures).summary() if failures else \
                "no rank of this node failed (the group restarted with another node's)"
        out.append(f"attempt {a.attempt}: {cause}")
    return tuple(out)


def hang_report(run: RunDir, attempt: int, world_size: int) -> HangReport | None:
    hang = run.hang()
    if hang is None or hang.attempt != attempt:
        return None    # no hang, or one of an earlier attempt that a restart recovered from
    stacks = {}
    for r in range(world_size):
        try:
            text = run.rank_file(attempt, r, "stacks").read_text()
        except OSError:
            text = ""
        if not text.strip():
            done = run.rank_file(attempt, r, "result.pkl").exists()
            stacks[r] = "(already finished: its function had returned)" if done else \
                "(no stack: the rank had already exited)"
        else:
            stacks[r] = annotate_stack(text.strip())
    return HangReport(hang.detected_by, hang.stuck_for, hang.where or "", stacks)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def result_warn_bytes() -> int:
    raw = os.environ.get("GPULAUNCH_RESULT_WARN_BYTES", "").strip()
    return int(raw) if raw.isdigit() else constants.RESULT_WARN_BYTES


def result_loader(run: RunDir, attempt: int, world_size: int, entry_kind: str = "function"):
    """Load the per-rank results (None for ranks of a script/command entry point).

    A function rank that ended with exit code 0 but wrote no result (``os._exit(0)`` inside
    the function) failed: it is reported, never turned into a silent None. A result the caller
    cannot unpickle (a class only the ranks can import, a device this process lacks) is a
    ``ResultLoadError`` naming the rank, the reason and the raw file, which stays on disk."""
    def load() -> list:
        results = []
        limit = result_warn_bytes()
        for r in range(world_size):
            path = run.rank_file(attempt, r, "result.pkl")
            if not path.exists():
                if entry_kind == "function":
                    raise errors.WorkerCrashError(
                        f"Rank {r} exited with code 0 without returning a result: the function "
                        "ended the process itself (os._exit(0), or a native library calling "
                        f"exit(0)) before it returned.\nRun directory: {run.path}",
                        rank=r, exit_code=0, run_dir=str(run.path),
                        log_tail=rank_log(run, attempt, r))
                results.append(None)
                continue
            size = path.stat().st_size
            if limit and size > limit:
                warnings.warn(f"gpulaunch: rank {r} returned a {_human(size)} result (over "
                              f"{_human(limit)}; GPULAUNCH_RESULT_WARN_BYTES): it travels "
                              "through the disk and the caller's memory; save large state to "
                              "a file inside the function and return its path instead.",
                              ResourceWarning, stacklevel=2)
            try:
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            except Exception as e:  # noqa: BLE001 - any failure of the unpickling
                raise errors.ResultLoadError(
                    f"The result of rank {r} could not be unpickled in the caller: "
                    f"{type(e).__name__}: {e}. Likely a class only the ranks can import (make "
                    "it importable here, or return plain data), or a device this process does "
                    f"not have. The raw pickle is kept at {path}", rank=r, path=str(path)) from e
        return results
    return load


def collect(run: RunDir, *, state: RunState, world_size: int, attempt: int,
            exits: dict[int, RankExit], reason: StopReason | None = None,
            timeout: float | None = None, agent_error: str | None = None,
            agent_traceback: str = "", lost: LostNode | None = None,
            oom_kills_at_start: int | None = None, nproc_per_node: int = 0,
            peer_failure=None, history=()) -> RunOutcome:
    """The outcome of a finished run from its directory plus what its backend knows."""
    record = run.launch()
    entry_kind = record.entry.kind if record else "function"
    oom_now = oom_kill_count()
    return RunOutcome(
        run_dir=str(run.path), world_size=world_size, state=state, reason=reason,
        timeout=timeout, attempt=attempt, entry_kind=entry_kind,
        failures=(rank_failures(run, attempt, exits)
                  if state is RunState.FAILED or lost is not None else ()),
        hang=hang_report(run, attempt, world_size), agent_error=agent_error,
        agent_traceback=agent_traceback, agent_log_tail=tail_text(run.agent_log, 30),
        lost=lost, rank0_log_tail=rank_log(run, attempt, 0, 15),
        oom_confirmed=(oom_now is not None and oom_kills_at_start is not None
                       and oom_now > oom_kills_at_start),
        nproc_per_node=nproc_per_node, peer_failure=peer_failure,
        history=attempt_causes(run, history),
        load_results=result_loader(run, attempt, world_size, entry_kind))

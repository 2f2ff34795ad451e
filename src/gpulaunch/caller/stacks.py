"""Stacks on demand: every rank's current Python stack, for a run that is NOT hung.

The mechanism is the hang watchdog's: each rank registers faulthandler on SIGUSR1, writing
every thread's stack into ``attempt<k>/rank<r>.stacks`` (rank/worker.py). Here we note each
file's size, signal the ranks, and read what was appended, so a second request never shows the
first one's dump. The format is the ``HangError`` report's (``--- rank r ---`` and the frames,
most recent call first, with source lines).

A rank is only signalled once its ``info.json`` exists: the worker writes that file after it
registered the handler, and before that SIGUSR1 would kill the process (its default action).
The same holds for an ``exec`` entry (the program replaced the worker), which is never
signalled. Ranks on another host (a Ray job) are reported as such: their node's agent owns
them.

When ``py-spy`` is on PATH, its ``--native`` dump is appended per rank (optional: it needs
ptrace permission, and its failure only costs that part).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from ..common import procutil
from ..common.rundir import RunDir, hostname
from .collect import annotate_stack

DUMP_SETTLE_S = 0.25     # faulthandler writes a dump in pieces; a quiet file is a whole dump
DUMP_TIMEOUT_S = 5.0
REMOTE_DUMP_TIMEOUT_S = 15.0   # a Ray job: the node agents dump, the mirror brings the files
PY_SPY_TIMEOUT_S = 10.0


class RankStacks(dict):
    """rank -> stack text; ``str()`` is the report in the HangError layout."""

    def __str__(self) -> str:
        return format_stacks(self)


def format_stacks(stacks: dict[int, str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{_indent(s)}" for r, s in sorted(stacks.items()))


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _rank_state(run: RunDir, attempt: int, rank: int, any_host: bool = False) -> str | None:
    """Why rank ``rank`` cannot be asked, or None when it can (``any_host``: its node's agent
    signals it, wherever it runs)."""
    if run.rank_file(attempt, rank, "result.pkl").exists():
        return "(already finished: its function had returned)"
    if run.rank_file(attempt, rank, "error.pkl").exists():
        return "(already failed: see its error)"
    info = run.rank_info(attempt, rank)
    if info is None:
        # On another host the rank's info.json reaches us with the run's next polls, after the
        # rank started: its node's agent, which holds the rank, decides (and may still dump).
        return None if any_host else "(not started yet)"
    if info.host != hostname():
        return None if any_host else f"(on host {info.host}: ask that node's agent)"
    if not procutil.pid_alive(info.pid):
        return "(no stack: the rank had already exited)"
    return None


def collect_stacks(run: RunDir, world_size: int, *, native: bool | None = None,
                   timeout: float = DUMP_TIMEOUT_S, dump=None) -> RankStacks:
    """Signal every live rank of the latest attempt and return its fresh stack.

    ``dump``: the backend's own way to have every rank dump (a Ray run asks each node's agent;
    its files then arrive through the run's polling); default: signal this host's ranks."""
    record = run.launch()
    attempts = run.attempts()
    if not attempts and dump is not None:
        # a Ray job's attempt folders reach this run directory with the run's polls, some
        # seconds after its ranks started: wait for them (bounded)
        attempts = _wait_for_attempts(run, REMOTE_DUMP_TIMEOUT_S)
    out = RankStacks()
    if not attempts:
        return RankStacks({r: "(not started yet)" for r in range(world_size)})
    attempt = attempts[-1]
    exec_entry = record is not None and record.entry.kind == "exec"
    asked: dict[int, tuple[int, int]] = {}        # rank -> (pid, file offset before)
    for r in range(world_size):
        why = "(an exec entry: the program has no gpulaunch handler)" if exec_entry \
            else _rank_state(run, attempt, r, any_host=dump is not None)
        if why:
            out[r] = why
            continue
        path = run.rank_file(attempt, r, "stacks")
        info = run.rank_info(attempt, r)
        asked[r] = (info.pid if info else None, _size(path))
    if dump is not None:
        dump()
        # the dumps travel with the mirror's polls: allow for a loaded caller
        timeout = max(timeout, REMOTE_DUMP_TIMEOUT_S)
    else:
        procutil.kill_pids([pid for pid, _ in asked.values()], signal.SIGUSR1)
    texts = _read_new(run, attempt, asked, timeout)
    use_spy = native if native is not None else shutil.which("py-spy") is not None
    for r, (pid, _) in asked.items():
        text = texts.get(r, "").strip()
        info = run.rank_info(attempt, r)
        if text:
            stack = annotate_stack(text)
        elif info is None:
            stack = "(not started yet)"
        else:
            stack = "(no stack: the rank did not answer)"
        if use_spy and info is not None and info.host == hostname():
            stack += "\n" + _py_spy(pid)
        out[r] = stack
    return RankStacks(sorted(out.items()))


def _wait_for_attempts(run: RunDir, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while not run.attempts() and time.monotonic() < deadline:
        time.sleep(0.1)
    return run.attempts()


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_new(run: RunDir, attempt: int, asked: dict, timeout: float) -> dict[int, str]:
    """Wait until every asked rank's file grew and then stayed quiet; return the new parts."""
    deadline = time.monotonic() + timeout
    sizes = {r: off for r, (_, off) in asked.items()}
    quiet_since = {r: None for r in asked}
    while time.monotonic() < deadline:
        for r in asked:
            size = _size(run.rank_file(attempt, r, "stacks"))
            if size != sizes[r]:
                sizes[r], quiet_since[r] = size, time.monotonic()
        now = time.monotonic()
        if all(sizes[r] > asked[r][1] and quiet_since[r] is not None
               and now - quiet_since[r] >= DUMP_SETTLE_S for r in asked):
            break
        time.sleep(0.05)
    out = {}
    for r, (_, off) in asked.items():
        try:
            with open(run.rank_file(attempt, r, "stacks"), "rb") as f:
                f.seek(off)
                out[r] = f.read().decode("utf-8", "replace")
        except OSError:
            out[r] = ""
    return out


def _py_spy(pid: int) -> str:
    try:
        p = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)],
                           capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(py-spy failed: {e})"
    if p.returncode != 0:
        return f"(py-spy failed: {(p.stderr or p.stdout).strip()[:300]})"
    return "native frames (py-spy):\n" + p.stdout.rstrip()

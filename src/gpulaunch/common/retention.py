"""Retention of old run directories: a notebook that launches for a week must not fill the disk.

Policy (both settable by environment variable, read at each prune):

* ``GPULAUNCH_KEEP_RUNS`` (default 100): the newest N run directories are always kept;
* ``GPULAUNCH_KEEP_DAYS`` (default 7): so is every directory newer than D days (fractions ok);
* a directory is removed only when it is outside both, and never while its run may be going:
  a run is *active* when its ``status.json`` is not in an end state and its node agent's pid
  or its caller's pid (``launch.json``, same host) is alive, or, before any status exists,
  its caller is alive,
  or when it is younger than ``ACTIVE_GRACE_S`` without any status (a launch being set up).

A kept directory that is no longer active still loses its ``payload.pkl`` (the pickled call:
possibly gigabytes, possibly secrets), which no one can read any more.

``prune()`` is called by the launch pipeline after every launch, bounded (``PRUNE_MAX_REMOVALS``
directories per call) and never raising; ``gpulaunch runs --gc`` calls it without the bound.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path

from . import procutil, rundir
from .records import NodeState

DEFAULT_KEEP_RUNS = 100
DEFAULT_KEEP_DAYS = 7.0
ACTIVE_GRACE_S = 3600.0        # a dir without status.json this young may be a launch in progress
PRUNE_MAX_REMOVALS = 20        # per launch: pruning never makes one launch slow


@dataclasses.dataclass(frozen=True)
class Policy:
    keep_runs: int = DEFAULT_KEEP_RUNS
    keep_days: float = DEFAULT_KEEP_DAYS

    @classmethod
    def from_env(cls, env=None) -> "Policy":
        env = os.environ if env is None else env
        return cls(keep_runs=_number("GPULAUNCH_KEEP_RUNS", env, DEFAULT_KEEP_RUNS, int),
                   keep_days=_number("GPULAUNCH_KEEP_DAYS", env, DEFAULT_KEEP_DAYS, float))


def _number(name: str, env, default, kind):
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: use a number >= 0 (default {default})")
    return value


@dataclasses.dataclass
class PruneReport:
    removed: list[str] = dataclasses.field(default_factory=list)
    payloads_dropped: list[str] = dataclasses.field(default_factory=list)
    kept_active: list[str] = dataclasses.field(default_factory=list)
    kept: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def _pid_alive(pid) -> bool:
    return isinstance(pid, int) and pid > 0 and procutil.pid_alive(pid)


def is_active(run: rundir.RunDir, now: float | None = None) -> bool:
    """May this run still be going (or being set up)? When in doubt: yes."""
    now = time.time() if now is None else now
    data = rundir.read_json(run.status_json)
    launch = rundir.read_json(run.launch_json) or {}
    caller_alive = launch.get("host") == rundir.hostname() and \
        _pid_alive(launch.get("caller_pid"))
    if data is None:
        if caller_alive:
            return True
        try:
            return now - run.path.stat().st_mtime < ACTIVE_GRACE_S
        except OSError:
            return False
    try:
        state = NodeState(data.get("state", NodeState.STARTING))
    except ValueError:
        return True
    if state.terminal:
        return False
    # the agent's pid is only meaningful here for a local run; a Ray run's mirrored status
    # names a pid of another machine: its caller (this host) being alive keeps it too
    return _pid_alive(data.get("agent_pid")) or caller_alive


def _run_dirs(root: Path) -> list[Path]:
    """Run directories, newest first (by modification time, then name)."""
    out = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return out
    for e in entries:
        if e.is_dir(follow_symlinks=False) and not e.name.startswith("."):
            try:
                out.append((e.stat(follow_symlinks=False).st_mtime, e.name, Path(e.path)))
            except OSError:
                continue
    out.sort(reverse=True)
    return [p for _, _, p in out]


def prune(policy: Policy | None = None, *, root: Path | None = None,
          max_removals: int | None = None, protect=(), now: float | None = None,
          quick: bool = False) -> PruneReport:
    """Apply the retention policy under ``root`` (default: this home's runs folder).

    protect: run directories that must stay whatever their age (the caller's own runs in
    flight).
    quick: a run the policy keeps and that has no payload left is counted without reading
    its records (active or not, nothing is done to it). The pipeline prunes after every
    launch in a thread of the caller: a home of a thousand recent runs is then a thousand
    stats, not a thousand status reads holding the GIL beside the caller's next call."""
    policy = policy or Policy.from_env()
    root = root or rundir.runs_root()
    now = time.time() if now is None else now
    protected = {os.path.realpath(p) for p in protect}
    report = PruneReport()
    cutoff = now - policy.keep_days * 86400.0
    for i, path in enumerate(_run_dirs(root)):
        run = rundir.RunDir(path)
        if quick and (i < policy.keep_runs or _newer(path, cutoff)) and \
                not run.payload.exists():
            report.kept += 1
            continue
        if os.path.realpath(path) in protected or is_active(run, now):
            report.kept_active.append(path.name)
            continue
        try:
            young = path.stat().st_mtime >= cutoff
        except OSError:
            continue
        if i < policy.keep_runs or young:
            report.kept += 1
            if run.drop_payload():
                report.payloads_dropped.append(path.name)
            continue
        if max_removals is not None and len(report.removed) >= max_removals:
            report.kept += 1
            continue
        try:
            shutil.rmtree(path)
            report.removed.append(path.name)
        except OSError as e:
            report.errors.append(f"{path.name}: {e}")
    return report


def _newer(path: Path, cutoff: float) -> bool:
    try:
        return path.stat().st_mtime >= cutoff
    except OSError:
        return False


def prune_quietly(protect=()) -> None:
    """The pipeline's call after a launch: bounded, and a launch never fails because of it."""
    try:
        prune(max_removals=PRUNE_MAX_REMOVALS, protect=protect, quick=True)
    except Exception:  # noqa: BLE001 - e.g. a bad GPULAUNCH_KEEP_RUNS: `runs --gc` reports it
        pass

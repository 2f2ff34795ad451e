"""``gpulaunch preempt [RUN] [--grace S] [--no-restart] [--all] [--wait]``: a preemption notice for a run
that another process started on this host, for a Kubernetes ``preStop`` hook or a node-drain
script. It writes the run's notice file (``common/preemption.py``), as ``handle.preempt()``
does: every rank saves a checkpoint of its step (``parallel.save_on_preemption``), and the
run's caller, which finds the notice in its run directory, keeps its deadline.

Default: the newest run on this host that is still going; ``--all``: every one of them.
``--wait``: return once each has saved its checkpoint (a ``preStop`` hook: Kubernetes sends
SIGTERM only after the hook returns).
"""

from __future__ import annotations

import os
import sys
import time

from .common import preemption, rundir
from .common.procutil import pid_alive
from .common.rundir import RunDir
from .errors import ConfigurationError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "preempt", help="post a preemption notice to a running run on this host (a preStop "
        "hook, a drain script): its ranks save a checkpoint within the grace period",
        description=__doc__.split("\n\n")[0])
    p.add_argument("run", nargs="?", default=None,
                   help="run id (or a unique prefix/suffix); default: the newest running run")
    p.add_argument("--all", action="store_true", help="every running run on this host")
    p.add_argument("--grace", type=float, default=None, metavar="S",
                   help="seconds for the checkpoint (default: $GPULAUNCH_PREEMPT_GRACE_S, "
                        "else 30)")
    p.add_argument("--wait", action="store_true",
                   help="return once the checkpoint is saved (or the grace is over): a "
                        "preStop hook, which Kubernetes waits for before it sends SIGTERM")
    p.add_argument("--no-restart", action="store_true",
                   help="the run stops after the checkpoint (PreemptedError), whatever its "
                        "max_preemptions; the next start resumes (use it when the machine goes)")


def _going(run: RunDir) -> str | None:
    """Why this run cannot take a notice (None: it is going, here, under a living caller)."""
    record = run.launch()
    if record is None:
        return "it has no launch record (not started yet, or not a run directory)"
    if record.backend != "local":
        return (f"it is a {record.backend} run: notices reach the ranks of runs on this host "
                "only")
    if record.host and record.host != rundir.hostname():
        return f"it runs on {record.host}, not on this host ({rundir.hostname()})"
    state = run.status().state
    if state.terminal:
        return f"it has ended ({state})"
    if not record.caller_pid or not pid_alive(int(record.caller_pid)):
        return f"it has ended (its caller, pid {record.caller_pid}, is gone)"
    return None


def _all_runs() -> list[RunDir]:
    root = rundir.runs_root()
    if not root.exists():
        return []
    return [RunDir(p) for p in sorted((p for p in root.iterdir() if p.is_dir()),
                                      key=lambda p: p.stat().st_mtime)]


def targets(ref: str | None, every: bool) -> list[RunDir]:
    """The runs the notice goes to, or a ConfigurationError saying why there is none."""
    runs = _all_runs()
    if ref is not None:
        if os.path.isdir(ref):
            matches = [RunDir(ref)]
        else:
            matches = [r for r in runs if r.run_id == ref or r.run_id.startswith(ref)
                       or r.run_id.endswith(ref)]
        if len(matches) != 1:
            raise ConfigurationError(f"no single run matches {ref!r} under {rundir.runs_root()} "
                                     f"({len(matches)} match); see `gpulaunch runs`")
        why = _going(matches[0])
        if why is not None:
            raise ConfigurationError(f"run {matches[0].run_id} cannot take a preemption notice: "
                                     f"{why}")
        return matches
    going = [r for r in runs if _going(r) is None]
    if not going:
        raise ConfigurationError(f"no running run on this host under {rundir.runs_root()} to "
                                 "preempt; see `gpulaunch runs`")
    return going if every else going[-1:]


def main(args) -> int:
    grace = args.grace if args.grace is not None else \
        preemption.env_float(os.environ, preemption.GRACE_ENV) or 30.0
    if grace <= 0:
        raise ConfigurationError(f"--grace must be a positive number of seconds, got {grace}")
    source = f"gpulaunch preempt from pid {os.getpid()}"
    posted = []
    for run in targets(args.run, args.all):
        attempt = (run.attempts() or [0])[-1]
        notice = preemption.post_notice(run.path, grace, source=source,
                                        restart=not args.no_restart)
        posted.append((run, attempt, notice))
        if notice.source != source:
            print(f"gpulaunch: run {run.run_id} already has a notice ({notice.source}), "
                  f"{notice.remaining():.3g} s left; left as it is")
            continue
        then = ("then stops (the next start resumes from it)" if args.no_restart else
                "then restarts from it here if its max_preemptions allows, else stops")
        print(f"gpulaunch: preemption notice posted to run {run.run_id}: its ranks save a "
              f"checkpoint within {grace:g} s, {then}")
    sys.stdout.flush()
    return _wait(posted) if args.wait else 0


def _saved(run: RunDir, since: int) -> dict | None:
    return next((s for a in run.attempts() if a >= since
                 for s in [preemption.read_saved(run.path, a)] if s is not None), None)


def _wait(posted) -> int:
    """Until each run has saved its checkpoint for the notice, or ended, or the grace (plus
    the caller's slack) is over; 1 if a run ended without one."""
    code = 0
    for run, attempt, notice in posted:
        while _saved(run, attempt) is None and _going(run) is None \
                and time.time() < notice.deadline + 2.0:
            time.sleep(0.1)
        saved = _saved(run, attempt)
        if saved is not None:
            print(f"gpulaunch: run {run.run_id}: checkpoint of step {saved['step']} saved in "
                  f"{saved['checkpoint']}, {saved['saved_at'] - notice.received_at:.2f} s after "
                  "the notice")
        else:
            code = 1
            print(f"gpulaunch: run {run.run_id}: no checkpoint for the notice "
                  f"({_going(run) or 'the grace period is over'})")
    sys.stdout.flush()
    return code

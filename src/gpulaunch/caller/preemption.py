"""The caller's part of a preemption: turn a notice into ``preempt.json`` for the ranks, and
keep its deadline.

* ``notice_signals(run)``: while ``.distributed()`` follows a run in the main thread with a
  grace period set (``preempt_grace=`` or ``$GPULAUNCH_PREEMPT_GRACE_S``), SIGTERM and SIGUSR1
  are notices, not an end: Kubernetes sends SIGTERM to the container's first process and waits
  ``terminationGracePeriodSeconds``; Slurm's ``--signal=B:USR1@N`` sends SIGUSR1 to the batch
  script N seconds before the end (``exec python train.py`` makes the caller that process).
  The caller itself is going away, so such a notice allows no restart here.
* ``post(run, grace_s, restart=True)`` (``handle.preempt()``): the same notice from code, for
  a node drain (``docs/fault-tolerance.md``); the run restarts from the checkpoint under
  ``max_preemptions``.
* ``check_deadline(run)`` (every poll of the controller): a notice whose grace period ended
  before the ranks had stopped stops every rank; ``result()`` then raises ``PreemptedError``.
  A notice file that another process wrote (``gpulaunch preempt``, a preStop hook) is kept
  the same way.
* ``caller/cloud_notices.py`` (``preempt_watch=``): a thread that polls the cloud's metadata
  service and calls ``post`` at its first notice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from ..common import preemption
from ..common.records import StopReason
from ..errors import ConfigurationError, PreemptedError

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEADLINE_SLACK_S = 1.0    # after the deadline, the ranks' own exit may still be on its way


def grace_of(spec) -> float | None:
    """The run's grace period: ``preempt_grace=`` (travels in spec.env), else the caller's
    ``$GPULAUNCH_PREEMPT_GRACE_S``; None: notices by signal are off."""
    return preemption.env_float(dict(spec.env), preemption.GRACE_ENV) \
        or preemption.env_float(os.environ, preemption.GRACE_ENV)


def _on_this_host(run) -> bool:
    """Notices travel through the run directory on this host: a Ray run's ranks do not read
    it (each node has its own)."""
    return getattr(run.record, "backend", "local") == "local"


def post(run, grace_s: float | None = None, *, source: str, restart: bool):
    """Post a notice for ``run`` (a RunController) and arm its deadline."""
    if not _on_this_host(run):
        raise ConfigurationError(
            f"preemption notices reach the ranks of runs on this host only; this run is on "
            f"{run.record.backend!r}. Checkpoint it periodically (save_checkpoint) instead.")
    grace = grace_s if grace_s is not None else (grace_of(run.spec) or 30.0)
    notice = preemption.post_notice(run.run.path, grace, source=source, restart=restart)
    run.preempt_notice = notice
    return notice


def check_deadline(run) -> None:
    """Called on every poll: stop the run once a notice's grace is over. A notice another
    process wrote into the run directory (``gpulaunch preempt``) arms it as one posted here
    does; a notice the node agent archived (the attempt restarted after its checkpoint)
    disarms it."""
    notice = getattr(run, "preempt_notice", None)
    if run.finished:
        return
    if notice is None:
        if not _on_this_host(run):
            return
        notice = preemption.read_notice(run.run.path)      # one failed open() without one
        if notice is None:
            return
        run.preempt_notice = notice
    elif preemption.read_notice(run.run.path) is None:
        run.preempt_notice = None                # restarted from the checkpoint: no deadline
        return
    if time.time() > notice.deadline + DEADLINE_SLACK_S:
        run.preempt_expired = notice
        run.stop(StopReason.CANCELLED)


def expired_error(run) -> PreemptedError | None:
    notice = getattr(run, "preempt_expired", None)
    if notice is None:
        return None
    attempts = run.run.attempts()
    saved = preemption.read_saved(run.run.path, attempts[-1]) if attempts else None
    if saved is not None:          # saved in time; the ranks' exit was what ran out of time
        return PreemptedError(
            f"Preempted ({notice.source}, grace {notice.grace_s:.3g} s): checkpoint of step "
            f"{saved['step']} saved in {saved['checkpoint']}, "
            f"{saved['saved_at'] - notice.received_at:.2f} s after the notice; the ranks were "
            "stopped at the end of the grace period. The next start resumes from it "
            "(parallel.resume).", step=saved["step"], checkpoint=saved["checkpoint"],
            run_dir=str(run.run.path))
    return PreemptedError(
        f"Preempted ({notice.source}, grace {notice.grace_s:.3g} s): the grace period ended "
        "before every rank had saved a checkpoint, and every rank was stopped. The next start "
        "resumes from the newest complete checkpoint (parallel.resume). Call "
        "parallel.save_on_preemption every step, and give a grace period longer than a step "
        "plus a checkpoint save (preempt_grace=).", run_dir=str(run.run.path))


@contextlib.contextmanager
def notice_signals(run):
    """SIGTERM / SIGUSR1 as preemption notices while the body runs (main thread only, and only
    with a grace period set); the previous handlers come back afterwards."""
    grace = grace_of(run.spec)
    if grace is None or threading.current_thread() is not threading.main_thread() \
            or not _on_this_host(run):
        yield
        return
    previous = {}

    def on_signal(signum, frame):
        post(run, grace, source=f"{signal.Signals(signum).name} to the caller", restart=False)

    try:
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, on_signal)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""The ``Run`` protocol: what every backend's run offers the launch pipeline.

    run.start()        begin (returns at once; ranks come up in the background)
    run.poll()         advance: stream logs, enforce the timeout; True once the run has ended
    run.pause(s)       sleep between polls, waking early when the run has news
    run.stop(reason)   end it now (cancel, timeout, caller exit): every rank stopped
    run.outcome()      the typed ``RunOutcome`` of an ended run (``caller.outcome.settle``)
    run.state          a ``RunState``; run.finished: ended and cleaned up
    run.describe()     one line for the announcement ("2 CPU worker processes ...")

Every backend's run is a ``caller.controller.RunController`` subclass (the controller owns the
lifecycle; the backend only starts, polls and stops): ``LocalRun`` runs the ranks on this host,
``PoolRun`` on the warm pool, ``RayRun`` one node agent per node, ``RayProgramRun`` a Ray
program once. The pipeline (``caller.pipeline``: its ``BACKENDS`` registry) and ``RunHandle``
know only this protocol.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from ..common.records import LaunchSpec, RunState, StopReason
from ..common.rundir import RunDir


@runtime_checkable
class Run(Protocol):
    run: RunDir
    spec: LaunchSpec
    label: str
    finished: bool

    def start(self) -> "Run": ...

    def poll(self) -> bool: ...

    def pause(self, seconds: float) -> None: ...

    def stop(self, reason: StopReason) -> None: ...

    def outcome(self): ...

    @property
    def state(self) -> RunState: ...

    def describe(self) -> str: ...


def poll_until_done(run: Run, interval: float, timeout: float | None = None) -> bool:
    """Poll ``run`` every ``interval`` s until it ends (True) or ``timeout`` s pass (False;
    the run goes on)."""
    end = None if timeout is None else time.monotonic() + timeout
    while not run.poll():
        if end is not None and time.monotonic() > end:
            return False
        run.pause(interval)
    return True

"""One run's lifecycle, the same for every backend: ``RunController``.

A backend (``LocalRun``, ``PoolRun``, ``RayRun``, ``RayProgramRun``) subclasses it and only
starts, polls and stops its processes; what a run IS lives here once (the shape of torch
elastic's ``SimpleElasticAgent``: ``_start`` / ``_poll`` / ``_stop`` filled in by a subclass,
the loop and the states by the base; restarts are asked of a ``FailurePolicy``, as Ray Train
v2's controller does):

    begin()   -> _start()  [backend]      callbacks.on_start    deadline armed
    advance() -> poll() -> _poll()        callbacks.on_poll     deadline: stop(TIMEOUT)
    stop(reason)  -> _stop(reason)        (cancel, timeout, the caller's exit)
    ended()       the end sequence, once: finished, unregistered (ACTIVE), callbacks.on_end

The state ladder (``state``):

    PENDING --begin--> RUNNING --(backend's final state)--> SUCCEEDED | FAILED
                          |--stop(TIMEOUT)--> TIMED_OUT
                          '--stop(CANCELLED)--> CANCELLED

A backend says how its run ended with ``_final_state()`` (SUCCEEDED or anything else; read once
the run is over); the reason a run was stopped always wins over it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from ..common import constants
from ..common.records import LaunchRecord, NodeState, RunState, StopReason
from ..common.rundir import RunDir
from . import preemption
from .registry import ACTIVE


class RunController:
    """The lifecycle of one run; subclasses fill in ``_start``, ``_poll``, ``_stop``,
    ``_final_state``, ``outcome`` and ``describe``."""

    poll_interval: float = constants.POLL_LOCAL_S
    # Stacks on demand (``handle.stacks()``): a backend whose ranks the caller cannot signal
    # by pid (Ray) sets a method that has them dump; None: the caller signals the pids.
    dump_stacks: Callable[[], None] | None = None
    # A preemption notice for this run (posted here, or found in its run directory: caller/
    # preemption.py), and the one whose grace period ran out before the ranks had stopped.
    preempt_notice = None
    preempt_expired = None

    def __init__(self, record: LaunchRecord, run: RunDir, *, callbacks=None):
        self.record, self.spec, self.run, self.label = record, record.spec, run, record.label
        self.callbacks = callbacks
        self.reason: StopReason | None = None
        self.finished = False
        self.running = False
        self._deadline: float | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ backend's part
    def _start(self) -> None:
        raise NotImplementedError

    def _poll(self) -> None:
        """Advance the run (stream logs, look at the processes); call ``ended()`` when it is
        over."""
        raise NotImplementedError

    def _stop(self, reason: StopReason) -> None:
        """Stop every process of the run now; ``ended()`` follows (here, or in the backend)."""
        raise NotImplementedError

    def _final_state(self) -> NodeState:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def outcome(self):
        raise NotImplementedError

    def pause(self, seconds: float) -> None:
        """Sleep between polls (a backend may wake early when its run has news)."""
        time.sleep(seconds)

    # ------------------------------------------------------------------ lifecycle
    def begin(self) -> "RunController":
        """Start the run (the pipeline's call); a start that fails ends the callbacks too."""
        try:
            self.start()
        except BaseException:
            if self.callbacks is not None:
                self.callbacks.on_end(self, RunState.CANCELLED
                                      if sys.exc_info()[0] is KeyboardInterrupt
                                      else RunState.FAILED)
            raise
        if self.callbacks is not None:
            self.callbacks.on_start(self)
        return self

    def start(self) -> "RunController":
        self._start()
        self.running = True
        if self.spec.timeout is not None and self._deadline is None:
            self._deadline = time.monotonic() + self.spec.timeout
        return self

    def poll(self) -> bool:
        """Advance the run and enforce its deadline; True once it has ended."""
        with self._lock:
            if self.finished:
                return True
            self._poll()
            if not self.finished and self._deadline is not None \
                    and time.monotonic() > self._deadline:
                self.stop(StopReason.TIMEOUT)
            preemption.check_deadline(self)      # a notice from here or from another process
            return self.finished

    step = poll   # the Ray node actor's spelling (a node's local run, no callbacks)

    def advance(self) -> bool:
        """One poll of the caller's loop (``RunHandle``): the callbacks' on_poll after it."""
        ended = self.poll()
        if not ended and self.callbacks is not None:
            self.callbacks.on_poll(self)
        return ended

    def stop(self, reason: StopReason) -> None:
        with self._lock:
            if self.finished:
                return
            self.reason = self.reason or StopReason(reason)
            self._stop(self.reason)
            self.ended()

    def ended(self) -> None:
        """The end sequence, once: the run is over, unregistered, and its callbacks told."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        ACTIVE.discard(self)
        if self.callbacks is not None:
            self.callbacks.on_end(self, self.state)

    # ------------------------------------------------------------------ the state ladder
    @property
    def state(self) -> RunState:
        if not self.finished:
            return RunState.RUNNING if self.running else RunState.PENDING
        if self.reason is StopReason.TIMEOUT:
            return RunState.TIMED_OUT
        if self.reason is StopReason.CANCELLED:
            return RunState.CANCELLED
        return RunState.SUCCEEDED if self._final_state() is NodeState.SUCCEEDED \
            else RunState.FAILED

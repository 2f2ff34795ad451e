"""Restart or give up: the one decision every backend that restarts a failed attempt asks for
(the warm pool, Ray; the node agent's restarts are torchelastic's loop with the same budget).
Modelled on Ray Train v2's ``FailurePolicy``: the run's controller reports each failed attempt;
the policy keeps the budget and the history, and answers.

    policy = FailurePolicy(max_restarts=2)
    if policy.decide(attempt, stopping=run.reason is not None) is Decision.RESTART:
        stop the attempt's ranks, find its cause
        policy.record(attempt, cause, exits)          # then start attempt + 1
    else: end the run

``policy.history`` (one ``AttemptRecord`` per failed attempt that was restarted) goes into the
run's outcome, so the final error names every earlier attempt's root cause.

A preempted attempt (its ranks saved a checkpoint for a preemption notice and stopped:
``common.preemption``) is asked with ``preempted=True`` and counted against
``max_preemptions`` alone, as Ray Train counts ``max_preemption_failures`` apart from
``max_failures``: preemptions never spend ``max_restarts``, failures never spend
``max_preemptions``.
"""

from __future__ import annotations

import enum
import time

from ..common.records import AttemptRecord, RankExit


class Decision(str, enum.Enum):
    RESTART = "RESTART"
    GIVE_UP = "GIVE_UP"


class FailurePolicy:
    def __init__(self, max_restarts: int = 0, max_preemptions: int = 0):
        self.max_restarts = int(max_restarts or 0)
        self.max_preemptions = int(max_preemptions or 0)
        self.history: list[AttemptRecord] = []

    @property
    def preemptions(self) -> int:
        return sum(1 for r in self.history if r.preempted)

    def decide(self, attempt: int, *, stopping: bool = False,
               preempted: bool = False) -> Decision:
        """Attempt ``attempt`` failed (or was preempted): restart, or give up when its budget
        is spent or the run is being stopped (timeout, cancel)."""
        if stopping:
            return Decision.GIVE_UP
        if preempted:
            return Decision.RESTART if self.preemptions < self.max_preemptions \
                else Decision.GIVE_UP
        if attempt - self.preemptions >= self.max_restarts:
            return Decision.GIVE_UP
        return Decision.RESTART

    def record(self, attempt: int, cause: str = "",
               exits: dict[int, RankExit] | None = None, *,
               preempted: bool = False) -> AttemptRecord:
        """A failed attempt for the history (its root cause in words, its failed ranks)."""
        rec = AttemptRecord(attempt, time.time(), dict(exits or {}), cause, preempted=preempted)
        self.history.append(rec)
        return rec

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
"""

from __future__ import annotations

import enum
import time

from ..common.records import AttemptRecord, RankExit


class Decision(str, enum.Enum):
    RESTART = "RESTART"
    GIVE_UP = "GIVE_UP"


class FailurePolicy:
    def __init__(self, max_restarts: int = 0):
        self.max_restarts = int(max_restarts or 0)
        self.history: list[AttemptRecord] = []

    def decide(self, attempt: int, *, stopping: bool = False) -> Decision:
        """Attempt ``attempt`` failed: restart, or give up when the budget is spent or the run
        is being stopped (timeout, cancel)."""
        if stopping or attempt >= self.max_restarts:
            return Decision.GIVE_UP
        return Decision.RESTART

    def record(self, attempt: int, cause: str = "",
               exits: dict[int, RankExit] | None = None) -> AttemptRecord:
        """A failed attempt for the history (its root cause in words, its failed ranks)."""
        rec = AttemptRecord(attempt, time.time(), dict(exits or {}), cause)
        self.history.append(rec)
        return rec

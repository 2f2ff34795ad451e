"""``rt.state``: the per-rank dict a warm pool keeps between calls (``gpulaunch.runtime.state``
is this module's ``RANK_STATE``; ``pool_worker`` reads and marks it)."""

from __future__ import annotations

from ..errors import StateDroppedError


class RankState(dict):
    """Per-rank state that persists across the calls of one warm pool (keep_alive=): a module
    global of the rank process, which a pool keeps alive between calls (rank.pool_worker). In a
    cold call it starts empty and ends with the rank. Load a model once, train, evaluate:
        if "model" not in rt.state: rt.state["model"] = build()

    When the pool's ranks restarted cold (a crash, a hang, a restart of ``max_restarts``), the
    new ranks know which keys the old ones held: reading one raises ``StateDroppedError``
    (why, and which call to re-run) instead of a bare KeyError further down."""

    def __init__(self):
        super().__init__()
        self.dropped: dict[str, str] = {}      # key -> label of the call that had set it
        self.dropped_why = ""

    def __missing__(self, key):
        if key in self.dropped:
            raise StateDroppedError(key, self.dropped_why, self.dropped[key])
        raise KeyError(key)

    def __setitem__(self, key, value) -> None:
        self.dropped.pop(key, None)
        super().__setitem__(key, value)

    def mark_dropped(self, keys: dict[str, str], why: str) -> None:
        """The keys a previous pool's ranks held (key -> the call that set it), and why they
        are gone."""
        self.dropped = {k: v for k, v in keys.items() if k not in self}
        self.dropped_why = why


RANK_STATE = RankState()


def owners(previous: dict[str, str], label: str) -> dict[str, str]:
    """After a call: every key ``RANK_STATE`` holds -> the call that first set it."""
    return {k: previous.get(k, label) for k in RANK_STATE if isinstance(k, str)}

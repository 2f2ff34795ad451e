"""Elastic size for replica groups: ``run_replicas(fn, replicas=(min, max), ...)``.

A run starts ``max`` replica groups (or as many as its :class:`Capacity` allows, at least
``min``). When a group fails and cannot be started again within ``node_lost_timeout`` seconds
(its capacity is gone, or its restart budget is spent), the run goes on with the groups that are
left, as long as at least ``min`` remain: torchft's quorum shrinks and every live group sees the
participant count change. When capacity returns, a group is started again; it joins the next
quorum and heals from a live peer. Every size change is recorded (:class:`SizeChange`).

This module is the pure part (no process is started here): the capacity source, the size-change
record and :func:`decide`, the policy the caller side (``replicas.py``) applies at each poll.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Callable, Literal, Union

from ..errors import ConfigurationError, RunError


class ReplicasBelowMinError(RunError):
    """An elastic run had fewer than ``min`` replica groups for longer than
    ``node_lost_timeout`` (or lost every group); every group was stopped."""


class Capacity:
    """How many replica groups may run at once: the caller's view of the nodes it has.

    ``run_replicas`` asks ``available()`` at every poll before it starts a group (a first start,
    a replacement or a group that grows the run back). Lowering it never stops a running group
    (a lost node's processes die with it); it only keeps a failed group from being replaced.

        cap = ft.Capacity(2)         # two nodes' worth of replica groups
        cap.take()                   # a node is gone: 1
        cap.give()                   # it is back: 2

        cap = ft.Capacity.file("/shared/capacity")   # an int in a file that another program
                                                     # (a node watcher, a scheduler hook) writes

    A file that is missing or unreadable keeps the last value read (``default`` before any).
    Any callable returning an int can stand in for a Capacity (``capacity=lambda: n_nodes()``).
    """

    def __init__(self, groups: int):
        _check_count("Capacity(groups)", groups)
        self._groups = groups
        self._path: Path | None = None
        self._lock = threading.Lock()

    @classmethod
    def file(cls, path: str | os.PathLike, default: int = 0) -> "Capacity":
        """A capacity read from ``path`` (one integer) at each ``available()``."""
        cap = cls(default)
        cap._path = Path(path)
        return cap

    def available(self) -> int:
        """How many replica groups may run now."""
        with self._lock:
            if self._path is not None:
                try:
                    self._groups = max(0, int(self._path.read_text().strip()))
                except (OSError, ValueError):
                    pass                # half-written or gone: the last value read stands
            return self._groups

    def set(self, groups: int) -> None:
        """Make ``groups`` replica groups' worth of capacity available (written atomically to
        the file of a ``Capacity.file``)."""
        _check_count("Capacity.set(groups)", groups)
        with self._lock:
            self._groups = groups
            if self._path is not None:
                tmp = self._path.with_name(self._path.name + ".tmp")
                tmp.write_text(f"{groups}\n")
                os.replace(tmp, self._path)

    def take(self, groups: int = 1) -> int:
        """``groups`` fewer (not below 0); returns the new value."""
        new = max(0, self.available() - groups)
        self.set(new)
        return new

    def give(self, groups: int = 1) -> int:
        """``groups`` more; returns the new value."""
        new = self.available() + groups
        self.set(new)
        return new

    def __call__(self) -> int:
        return self.available()

    def __repr__(self) -> str:
        where = f" file={str(self._path)!r}" if self._path is not None else ""
        return f"Capacity({self._groups}{where})"


CapacityLike = Union[Capacity, int, Callable[[], int], None]


def _check_count(what: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigurationError(f"{what} must be an int >= 0, got {n!r}")


def as_capacity(capacity: CapacityLike, max_size: int) -> Callable[[], int]:
    """A callable giving the capacity now: ``None`` is ``max_size`` always."""
    if capacity is None:
        return lambda: max_size
    if isinstance(capacity, Capacity):
        return capacity.available
    if isinstance(capacity, int) and not isinstance(capacity, bool):
        return Capacity(capacity).available
    if callable(capacity):
        return capacity
    raise ConfigurationError(f"capacity={capacity!r}: give a gpulaunch.ft.Capacity, an int or a "
                             "callable returning how many replica groups may run now")


@dataclasses.dataclass(frozen=True)
class ElasticSize:
    """The size settings of an elastic run, checked."""

    min: int
    max: int
    node_lost_timeout: float


def parse_replicas(replicas, *, node_lost_timeout=None, capacity=None,
                   spares: int = 1) -> ElasticSize | None:
    """``None`` for a fixed size (``replicas=N``), else the checked ``(min, max)`` settings.
    Raises ConfigurationError naming the problem and the fix."""
    if isinstance(replicas, list):
        replicas = tuple(replicas)
    if not isinstance(replicas, tuple):
        if node_lost_timeout is not None or capacity is not None:
            which = "node_lost_timeout" if node_lost_timeout is not None else "capacity"
            raise ConfigurationError(
                f"run_replicas(..., {which}=...) applies to an elastic run: pass "
                f"replicas=(min, max) (e.g. replicas=(1, {replicas})), or drop {which}=")
        return None
    if len(replicas) != 2 or not all(isinstance(n, int) and not isinstance(n, bool)
                                     for n in replicas):
        raise ConfigurationError(f"replicas={replicas!r}: an elastic size is a pair of ints "
                                 "(min, max), e.g. replicas=(1, 2)")
    lo, hi = replicas
    if lo < 1:
        raise ConfigurationError(f"replicas={replicas!r}: min must be >= 1 (a step needs at "
                                 "least one replica group); e.g. replicas=(1, "
                                 f"{max(hi, 2)})")
    if lo > hi:
        raise ConfigurationError(f"replicas={replicas!r}: min ({lo}) is above max ({hi}); "
                                 f"write replicas=({hi}, {lo})")
    if lo == hi:
        raise ConfigurationError(f"replicas={replicas!r}: min equals max, so the size cannot "
                                 f"change; pass replicas={lo} for a fixed size, or a min below "
                                 "max")
    if node_lost_timeout is None:
        node_lost_timeout = 60.0
    if isinstance(node_lost_timeout, bool) or not isinstance(node_lost_timeout, (int, float)) \
            or node_lost_timeout < 0:
        raise ConfigurationError(f"node_lost_timeout must be a number of seconds >= 0, got "
                                 f"{node_lost_timeout!r}")
    if isinstance(spares, int) and spares > hi - 1:
        raise ConfigurationError(
            f"spares={spares} with replicas={replicas!r}: a spare stands in for a failed group "
            f"while at least one other group runs, so at most max - 1 = {hi - 1} can ever be "
            f"used; pass spares={min(1, hi - 1)}")
    return ElasticSize(lo, hi, float(node_lost_timeout))


@dataclasses.dataclass
class SizeChange:
    """The run went from ``from_size`` replica groups to ``to_size``."""

    at: float                     # time.time(): a group declared lost, or a group's first commit
    step: int                     # the run's step then (the grown group's first committed step)
    from_size: int
    to_size: int
    replica: int                  # the group that left or joined
    reason: str                   # one line: why

    def __str__(self) -> str:
        return f"{self.from_size} -> {self.to_size} at step {self.step}: {self.reason}"


def shards_for(rank: int | None, participants: int, total: int, *,
               first: bool = False) -> list[int]:
    """The shards (of ``total`` per step) that the group of participating ``rank`` trains on
    when ``participants`` groups take part: ``rank, rank + participants, ...``. Every shard goes
    to exactly one group and every group gets at least one (a group that does not take part,
    ``rank=None``, a healing one, gets rank 0's: torchft zeroes its gradient).

    ``first``: the run's first step (step 0). There torchft makes the groups' weights equal
    (``init_sync``) by healing every group of the quorum but one from that one, counting them
    all as participants: only one group's gradient counts. So every group gets every shard, and
    the one that counts covers the global batch (its loss weight ``participants / total`` and
    torchft's average over the participants make its gradient the mean over all shards)."""
    if first:
        rank, participants = None, 1
    n = max(1, participants)
    if isinstance(total, bool) or not isinstance(total, int) or total < n:
        raise ConfigurationError(
            f"{total!r} shards per step for {n} live replica groups: every group needs at "
            "least one (use total >= the run's max replica groups; the default is "
            "ft.num_replicas())")
    start = rank if rank is not None and 0 <= rank < n else 0
    return list(range(start, total, n))


# ---------------------------------------------------------------------------------- the policy

SlotState = Literal["running", "waiting", "lost", "done"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One replica group as the policy sees it.

    running: launched (maybe still starting or healing); waiting: failed at ``since``, may
    still be replaced within ``node_lost_timeout``; lost: not a member of the run now (never
    started, or not replaced in time); done: finished. ``can_start``: its restart budget allows
    another start."""

    replica: int
    state: SlotState
    since: float = 0.0
    can_start: bool = True


@dataclasses.dataclass(frozen=True)
class Decision:
    start: tuple[int, ...] = ()       # launch these groups now (a replacement or a growth)
    lose: tuple[int, ...] = ()        # declare these waiting groups lost (the run shrinks)
    fail: str | None = None           # end the run with this error


def decide(slots: list[Slot], *, now: float, capacity: int, min_size: int,
           node_lost_timeout: float, ending: bool, committed: bool) -> Decision:
    """What to do at this poll.

    - Start waiting groups (oldest failure first), then lost ones, while ``capacity`` exceeds
      the running groups and their budget allows; never once a group has finished (``ending``:
      nobody would be left to heal from), and never when no group runs after steps were
      committed (the newcomer would have nobody to heal from).
    - A waiting group that cannot start is lost after ``node_lost_timeout`` (at once when its
      budget is spent: no capacity will bring it back).
    - Fewer than ``min_size`` running and waiting groups: the run fails (torchft's quorum needs
      ``min_size``; the groups left would wait for it forever). So does a run whose every group
      is gone after steps were committed.
    """
    running = sum(s.state == "running" for s in slots)
    if ending:
        return Decision()
    if running == 0 and committed and any(s.state in ("waiting", "lost") for s in slots):
        return Decision(fail="every replica group has failed, so none is left to take the "
                             "current weights from")
    free = capacity - running
    start: list[int] = []
    order = sorted((s for s in slots if s.state == "waiting"), key=lambda s: s.since) + \
        [s for s in slots if s.state == "lost"]
    for s in order:
        if free <= 0:
            break
        if s.can_start:
            start.append(s.replica)
            free -= 1
    lose = tuple(s.replica for s in slots if s.state == "waiting" and s.replica not in start
                 and (not s.can_start or now - s.since >= node_lost_timeout))
    members = running + len(start) + sum(s.state == "waiting" and s.replica not in start
                                         and s.replica not in lose for s in slots)
    if members < min_size:
        return Decision(lose=lose, fail=(
            f"{members} replica group(s) left, fewer than min={min_size}, and no capacity came "
            f"back within node_lost_timeout={node_lost_timeout:g} s (capacity now {capacity})"))
    return Decision(start=tuple(start), lose=lose)

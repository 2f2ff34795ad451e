"""Caller side: start N replica groups, restart a failed one alone while the others step on.

    from gpulaunch import ft

    result = ft.run_replicas(train, 200, replicas=3, max_group_restarts=5)
    result.results, result.failures   # each group's last results; [ReplicaFailure(...), ...]

Each replica group is an ordinary gpulaunch launch (the launch pipeline: its own agent, ranks,
rendezvous and logs), told its replica number and the lighthouse's address. The
lighthouse (a child process of the caller, ``lighthouse.py``) is started first and supervised:
if it dies it is started again on the same port, ``max_lighthouse_restarts`` times. When a
group fails, only that group is launched again; it joins the live groups' next quorum and takes
their weights and optimizer state (``replicated.py``). Once one group has finished, failed
groups are no longer restarted (there would be nobody to heal from).

Elastic size (``replicas=(min, max)``, ``elastic.py``): a failed group is started again only when
the run's :class:`~gpulaunch.ft.Capacity` allows it; one not started within
``node_lost_timeout`` is lost and the run goes on smaller (never below ``min``), and a group is
started again when capacity returns, healing from a live peer like any replacement.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..common.procutil import pid_alive
from ..errors import RunError
from .device_slots import DeviceSlots
from .elastic import (
    CapacityLike,
    ReplicasBelowMinError,
    SizeChange,
    as_capacity,
    parse_replicas,
)
from .elastic_sizing import ElasticSizing
from .lighthouse import Lighthouse, LighthouseError
from .options import check_options
from .replica_entry import ENV_SPARE, replica_entry
from .replicated import (
    ENV_ATTEMPT,
    ENV_DIR,
    ENV_FIRST,
    ENV_HEAL_FROM,
    ENV_LIGHTHOUSE,
    ENV_MIN,
    ENV_REPLICA,
    ENV_REPLICAS,
)
from .result import ReplicaFailure, ReplicasResult, group_pids, one_line, read_steps


class ReplicaGroups(ElasticSizing):
    """The supervisor behind :func:`run_replicas`; usable directly to watch a run in flight
    (``start()``, then ``poll()`` until it returns True, then ``finish()``)."""

    def __init__(self, fn, args=(), kwargs=None, *, replicas: int | tuple[int, int] = 2,
                 ranks_per_group: int = 1, gpus_per_replica: int = 1,
                 max_group_restarts: int = 3,
                 lighthouse: str | Lighthouse | None = None, max_lighthouse_restarts: int = 3,
                 heartbeat_timeout_ms: int = 1000, ft_dir: str | None = None,
                 spares: int = 1, node_lost_timeout: float | None = None,
                 capacity: CapacityLike = None, **launch_options):
        self.elastic = parse_replicas(replicas, node_lost_timeout=node_lost_timeout,
                                      capacity=capacity, spares=spares)
        if self.elastic is not None:
            replicas = self.elastic.max
        # one launch of ranks_per_group ranks per group (HSDP when > 1: sharded.py)
        self.ranks_per_group = check_options(
            replicas=replicas, max_group_restarts=max_group_restarts, spares=spares,
            ranks_per_group=ranks_per_group, gpus_per_replica=gpus_per_replica,
            launch_options=launch_options)
        self.extra_env = dict(launch_options.pop("extra_env", None) or {})
        # One compute thread per process, as torchrun gives each of several ranks: N groups
        # and a spare each taking every core would crowd each other out (3.6x slower steps
        # measured on 2 cores).
        if "OMP_NUM_THREADS" not in os.environ:
            self.extra_env.setdefault("OMP_NUM_THREADS", "1")
        self.fn = getattr(fn, "func", fn)         # a DistributedFunction or a plain function
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.replicas = replicas
        self.max_group_restarts = max_group_restarts
        self.max_lighthouse_restarts = max_lighthouse_restarts
        self.spares = spares if max_group_restarts > 0 else 0
        # each group's launch its own GPUs (device_slots.py); None on a CPU host
        self._slots = DeviceSlots.for_host(self.ranks_per_group, self.extra_env)
        if self._slots is not None:
            self.spares = self._slots.check(replicas, self.spares)
        self._spares: list[tuple[Path, Any]] = []      # (assignment file, handle), waiting
        self._spare_count = 0
        self._dying: list[tuple[ReplicaFailure, Any]] = []  # failed, launch not yet ended
        self.launch_options = {"stream_logs": "none", "tracking": False, "panel": False,
                               **launch_options}
        self._lighthouse_arg = lighthouse
        self._heartbeat_ms = heartbeat_timeout_ms
        self._own_dir = ft_dir is None
        self.ft_dir = Path(ft_dir or tempfile.mkdtemp(prefix="gpulaunch-ft-"))
        self.lighthouse: Lighthouse | None = None
        self.handles: dict[int, Any] = {}
        self.attempts = {i: 0 for i in range(replicas)}
        self.results: dict[int, list] = {}
        self.failures: list[ReplicaFailure] = []
        self.given_up: list[int] = []
        self._t0 = None
        self._started = False               # the first groups are launched
        self._first: list[int] = []
        # elastic size (elastic.py): each group's state, the run's size and its changes
        self._capacity = as_capacity(capacity, replicas) if self.elastic else None
        self._state: dict[int, str] = {}    # replica -> running / waiting / lost / done
        self._since: dict[int, float] = {}  # replica -> when it started waiting
        self._launched: set[int] = set()
        self._growing: dict[int, int] = {}  # replica -> attempt whose first commit grows the run
        self.size = 0
        self.size_changes: list[SizeChange] = []

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "ReplicaGroups":
        self._t0 = time.monotonic()
        os.makedirs(self.ft_dir, mode=0o700, exist_ok=True)
        lh = self._lighthouse_arg
        if isinstance(lh, Lighthouse):
            self.lighthouse = lh
        elif isinstance(lh, str):
            self.lighthouse = Lighthouse.at(lh)
        else:
            self.lighthouse = Lighthouse.start(
                heartbeat_timeout_ms=self._heartbeat_ms,
                min_replicas=self.elastic.min if self.elastic else 1)
        try:
            first = range(self.replicas)
            if self.elastic:
                allowed = self._capacity()
                if allowed < self.elastic.min:
                    raise ReplicasBelowMinError(
                        f"the capacity allows {allowed} replica group(s) at the start, fewer "
                        f"than min={self.elastic.min}: give it more (Capacity.set) or lower min")
                first = range(min(self.replicas, allowed))
                self._state = {i: "running" if i in first else "lost"
                               for i in range(self.replicas)}
                self.size = len(first)
            self._first = list(first)
            for i in first:
                self._launch(i)
            self._started = True
            for _ in range(self.spares):
                self._launch_spare()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def step(self) -> int:
        """The run's step: the highest any group has committed (0 before the first)."""
        return max((r["step"] for i in range(self.replicas)
                    for r in read_steps(self.ft_dir, i)[-1:]), default=0)

    def _run_step(self) -> int:
        return self.step

    def _replica_env(self, replica: int) -> dict[str, str]:
        late = self._started or self.attempts[replica] > 0
        return {ENV_REPLICA: str(replica), ENV_ATTEMPT: str(self.attempts[replica]),
                ENV_HEAL_FROM: str(self._run_step() if late else -1),
                # a first start waits for the other first starts before its first quorum
                ENV_FIRST: "" if late else ",".join(map(str, self._first)),
                "REPLICA_GROUP_ID": str(replica)}

    def _submit(self, env: dict[str, str]):
        # the launch pipeline .submit() calls, not the decorator (built on this module)
        from ..caller import handle, pipeline
        from ..common.records import Entry
        from ..options import build
        env = {**self.extra_env, ENV_REPLICAS: str(self.replicas), ENV_DIR: str(self.ft_dir),
               ENV_LIGHTHOUSE: self.lighthouse.address,
               ENV_MIN: str(self.elastic.min if self.elastic else 1),
               "NUM_REPLICA_GROUPS": str(self.replicas), **env}
        slot = None
        if self._slots is not None:
            slot = self._slots.take()
            if slot is None:
                raise RunError("no free GPUs for a replica group's launch: every slot is held "
                               "by a group still running (a bug: please report it)")
            env["CUDA_VISIBLE_DEVICES"] = slot[1]
        run = pipeline.launch(build(gpus=self.ranks_per_group, env=env, **self.launch_options),
                              Entry("function"),
                              label=getattr(self.fn, "__name__", "replica"),   # the user's name
                              call=(replica_entry, (self.fn, self.args, self.kwargs), {}, {}),
                              stream=False, standby=True)
        h = handle.RunHandle(run, background=True)
        if slot is not None:
            self._slots.bind(slot[0], h)
        return h

    def _let_go(self, handle) -> None:
        """The caller is done with ``handle``'s launch (ended, or its ranks died): its GPUs
        may go to the next launch."""
        if self._slots is not None:
            self._slots.release(handle)

    def _launch(self, replica: int) -> None:
        """Start ``replica``'s current attempt: on a waiting spare if there is one."""
        self._launched.add(replica)
        env = self._replica_env(replica)
        while self._spares:
            path, handle = self._spares.pop(0)
            if handle.done():               # a spare that died while waiting: not usable
                continue
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(env))
            os.replace(tmp, path)           # the spare reads it whole or not at all
            self.handles[replica] = handle
            self._launch_spare()
            return
        self.handles[replica] = self._submit(env)

    def _launch_spare(self) -> None:
        if len(self._spares) >= self.spares:
            return
        path = self.ft_dir / f"spare{self._spare_count}.assign"
        self._spare_count += 1
        self._spares.append((path, self._submit({ENV_SPARE: str(path)})))

    def poll(self) -> bool:
        """Check the lighthouse and every group once; restart what failed. True when every
        group has ended (finished or given up)."""
        self._check_lighthouse()
        if self.results:                    # the run is ending: spares are not needed
            for _, handle in self._spares:
                handle.cancel()
                self._let_go(handle)
            self._spares.clear()
        for replica, handle in list(self.handles.items()):
            if handle.done():
                del self.handles[replica]
                self._let_go(handle)
                try:
                    self.results[replica] = handle.result()
                    self._state[replica] = "done"
                except Exception as e:  # noqa: BLE001 - the rank's own error type comes back too
                    self._failed(replica, one_line(e))
            elif self._rank_died(replica):
                # Seen from the rank's pid at once; the launch reports it a while later (its
                # agent notices, stops the group, writes the outcome): its error is filled in
                # then, the replacement starts now.
                del self.handles[replica]
                self._let_go(handle)
                self._dying.append((self._failed(replica, "a rank process died"), handle))
        for failure, handle in list(self._dying):
            if handle.done():
                self._dying.remove((failure, handle))
                try:
                    handle.result()
                except Exception as e:  # noqa: BLE001
                    failure.error = one_line(e)
        if self.elastic:
            self._resize()
        self._fill_in_rejoins()
        if self.elastic:
            self._record_growth()
            if not self.results and "waiting" in self._state.values():
                return False                # it may still come back within node_lost_timeout
        return not self.handles

    def _rank_died(self, replica: int) -> bool:
        attempt = self.attempts[replica]
        if (self.ft_dir / f"replica{replica}.attempt{attempt}.done").exists():
            return False
        return any(not pid_alive(p) for p in group_pids(self.ft_dir, replica, attempt))

    def _failed(self, replica: int, error: str) -> ReplicaFailure:
        attempt = self.attempts[replica]
        mine = [r for r in read_steps(self.ft_dir, replica) if r.get("a") == attempt]
        # no restart once a group has finished: the run is ending and nobody is left to heal from
        restart = attempt < self.max_group_restarts and not self.results
        failure = ReplicaFailure(
            replica=replica, attempt=attempt, failed_at=time.time(), error=error,
            last_step=mine[-1]["step"] if mine else None,
            restarted=restart and not self.elastic)
        self.failures.append(failure)
        if self.elastic:
            # started again by _resize() when the capacity allows; a group that failed before
            # it joined (a growth) was not a member of the run: it is simply lost again
            if self._growing.pop(replica, None) is not None:
                self._state[replica] = "lost"
            else:
                self._state[replica] = "waiting"
                self._since[replica] = time.monotonic()
        elif restart:
            self.attempts[replica] += 1
            self._launch(replica)
        else:
            self.given_up.append(replica)
        return failure

    def _fill_in_rejoins(self) -> None:
        """For each failure whose group has committed again: when, at which step, and how
        many run steps it missed."""
        for f in self.failures:
            if f.rejoined_at is not None or not f.restarted:
                continue
            nxt = [r for r in read_steps(self.ft_dir, f.replica) if r.get("a") == f.attempt + 1]
            if nxt:
                first = nxt[0]
                f.rejoined_at = first["t"]
                f.healed_to = first.get("healed_to")
                start = f.last_step or 0
                f.steps_missed = max(0, first["step"] - 1 - start)

    def _check_lighthouse(self) -> None:
        lh = self.lighthouse
        if lh is None or lh.alive():
            return
        if lh.restarts >= self.max_lighthouse_restarts:
            self.stop()
            raise LighthouseError(
                f"the torchft lighthouse ({lh.address}) died {lh.restarts + 1} times "
                f"(max_lighthouse_restarts={self.max_lighthouse_restarts}); every replica "
                "group was stopped.")
        lh.restart()

    def stop(self) -> None:
        """Stop every group still running and the lighthouse we started."""
        for handle in (list(self.handles.values()) + [h for _, h in self._spares]
                       + [h for _, h in self._dying]):
            try:
                handle.cancel()
            except Exception:  # noqa: BLE001 - stopping the others matters more
                pass
        self.handles.clear()
        self._spares.clear()
        self._dying.clear()
        if self.lighthouse is not None:
            self.lighthouse.stop()

    def finish(self) -> ReplicasResult:
        self.stop()
        steps = {i: read_steps(self.ft_dir, i) for i in range(self.replicas)}
        given_up = set(self.given_up)
        if self.elastic:        # a group that failed and was never back
            given_up |= {r for r, st in self._state.items()
                         if st in ("waiting", "lost") and r in self._launched}
        result = ReplicasResult(results=dict(sorted(self.results.items())),
                                failures=self.failures, given_up=sorted(given_up),
                                lighthouse_restarts=self.lighthouse.restarts
                                if self.lighthouse else 0,
                                wall_s=time.monotonic() - self._t0, steps=steps,
                                size_changes=list(self.size_changes))
        if self._own_dir:
            shutil.rmtree(self.ft_dir, ignore_errors=True)
        return result

"""Restarts of a whole Ray job (``max_restarts=N`` with ``remote=True``).

A rank that fails, or a node that is lost, ends the job's current attempt on every node at
once; the caller (``RayRun``) then starts the next attempt, until one succeeds or N restarts
are spent. Data flow of one attempt k (the caller drives it; no node restarts on its own):

    start   one ``NodeAgent`` actor per bundle of the job's placement group (kept from
            attempt 0: same bundles, so the same nodes while they live), each given k:
              - its node-local run directory is ``runs/<run id>`` (k = 0) or
                ``runs/<run id>.attempt<k>``: fresh, whatever is left of the last attempt;
              - its local agent runs with ``NodePlacement.first_attempt = k`` and
                ``max_restarts = k``: torchelastic numbers the attempt k
                (``TORCHELASTIC_RESTART_COUNT``, so ``rt.get_restart_count() == k`` on every
                rank of every node) with no restart of its own left, and the ranks write into
                ``attempt<k>/`` as on a single host;
            node 0 opens a new rendezvous store (a new port); the others learn it: a fresh
            rendezvous on every node.
    follow  polls mirror ``attempt<k>/rank<r>.*`` into the caller's run directory (the layout
            of a local run with restarts, read the same way by ``caller.collect``).
    failed  a rank's own error file arrives (``ErrorWatch``), a node reports FAILED (a
            rank's exit), a hang, or a node is lost (its actor died, its machine left, it
            stopped answering): every node's ranks are stopped
            (``stop``, SIGTERM then SIGKILL), their last files drained, and the attempt's root
            cause, read from ``attempt<k>/`` (``attempt_cause``), is appended to the job's
            history (``JobStatus.history`` in job.json: ``AttemptRecord(k, ended, failures,
            cause)``). Then, if restarts are left: the attempt's actors are killed, the
            placement group waited for (``wait_placement``: a probe task answers from a live
            node in every bundle; Ray re-reserves the bundle of a node that is gone on another
            node, within ``RayCluster.placement_timeout``), and
            attempt k + 1 starts. If none are left, the job ends: the caller raises attempt k's
            error, naming every earlier attempt's root cause (``RunOutcome.history``).

``timeout=`` covers the whole job, all attempts together.
"""

from __future__ import annotations

import time

from ...caller import collect
from ...caller.outcome import root_cause
from ...common.records import RankExit
from ...common.rundir import RunDir
from ...errors import LaunchError
from . import calls


class ErrorWatch:
    """Rank error files as they reach the caller's mirror, read once each.

    A rank that raised on its own account (not collateral: a peer's broken connection) has
    failed the attempt the moment its error.pkl is written; its process, and its node's
    agent, may take seconds more to end (the process group's teardown after a peer broke).
    The caller stops every node then, instead of waiting for the nodes to end by themselves
    (``bench/ray_fault_time.py``). Collateral errors alone do not: the root cause (a rank
    killed without a Python exception) must first be recorded by its node's agent. With
    ``debug=True`` a failed rank stays alive for ``gpulaunch debug``: never early there."""

    def __init__(self, run: RunDir, *, enabled: bool):
        self.run, self.enabled = run, enabled
        self._read: dict[tuple[int, int], bool] = {}     # (attempt, rank) -> its own error

    def scan(self, attempt: int) -> None:
        adir = self.run.attempt_dir(attempt)
        if not self.enabled or not adir.is_dir():
            return
        for p in adir.glob("rank*.error.pkl"):
            rank = int(p.name[len("rank"):].split(".", 1)[0])
            if (attempt, rank) not in self._read:
                err = collect.rank_error(self.run, attempt, rank)
                self._read[(attempt, rank)] = err is not None and not err.collateral

    def own_failure(self, attempt: int) -> bool:
        """A rank of ``attempt`` raised on its own account (its error file is here)."""
        self.scan(attempt)
        return any(own for (a, _), own in self._read.items() if a == attempt)

    def raised(self, attempt: int) -> list[int]:
        return sorted(r for (a, r) in self._read if a == attempt)


def attempt_exits(run: RunDir, nodes, attempt: int) -> dict[int, RankExit]:
    """The attempt's failed ranks: as their nodes' agents recorded them, plus every rank that
    wrote an error file but was stopped by the caller before its agent recorded its exit."""
    exits: dict[int, RankExit] = {}
    for n in nodes:
        exits.update(n.status.failures)
    adir = run.attempt_dir(attempt)
    for p in sorted(adir.glob("rank*.error.pkl")) if adir.is_dir() else []:
        rank = int(p.name[len("rank"):].split(".", 1)[0])
        if rank not in exits:
            err = collect.rank_error(run, attempt, rank)
            code = err.exit_code if err is not None and err.exit_code is not None else 1
            exits[rank] = RankExit(rank=rank, exitcode=code, timestamp=err.time if err else 0.0,
                                   message="stopped by the caller after its error")
    return exits


def attempt_cause(run: RunDir, nodes, attempt: int, world_size: int,
                  nproc_per_node: int) -> str:
    """Attempt ``attempt``'s root cause in one line (its nodes stopped and drained)."""
    hang = collect.hang_report(run, attempt, world_size)
    if hang is not None:
        where = (hang.where.strip().splitlines() or ["?"])[-1].strip()
        return (f"hang: rank {hang.detected_by} made no progress for {hang.stuck_for:g} s "
                f"(at {where})")
    lost = next((n for n in nodes if n.lost_why is not None), None)
    failures = collect.rank_failures(run, attempt, attempt_exits(run, nodes, attempt))
    if failures:
        root = root_cause(failures)
        node = f" (node {root.rank // nproc_per_node})" if nproc_per_node else ""
        if lost is None or root.priority < 2:
            return root.summary() + node
    if lost is not None:
        return f"node {lost.node_rank} lost ({lost.describe(nproc_per_node)}): {lost.lost_why}"
    broken = next((n for n in nodes if n.status.error), None)
    if broken is not None:
        return f"node {broken.node_rank}'s agent failed: {broken.status.error}"
    return "the attempt failed, and no rank reported why"


def _bundle_node() -> str:
    import ray
    return ray.get_runtime_context().get_node_id()


def wait_placement(ray, pg, nnodes: int, timeout: float, *, probe_resources: dict) -> list[str]:
    """Wait (bounded) until every bundle of the job's placement group is held by a live node,
    and return their Ray node ids. After a node's agent was killed the bundle is still there;
    after its machine went, Ray declares the node dead (missed heartbeats: seconds) and
    reschedules the bundle onto another node that can hold it. A probe task in each bundle
    (a sliver of the bundle's own resource, freed by the killed agent) answers only from a live
    node; one that fails (its raylet gone, the group rescheduling) is sent again until
    ``timeout``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    probe = ray.remote(_bundle_node)
    start = time.monotonic()
    last = ""
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            break
        refs = [probe.options(**probe_resources, max_retries=0, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(placement_group=pg,
                                             placement_group_bundle_index=i))).remote()
                for i in range(nnodes)]
        try:
            return list(calls.get(ray, refs, timeout=left))
        except Exception as e:  # noqa: BLE001 - GetTimeoutError, a dead node, a removed group
            last = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
            for ref in refs:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001
                    pass
            if type(e).__name__ == "GetTimeoutError":
                break
            time.sleep(1.0)
    raise LaunchError(
        f"The job's placement could not be re-reserved within {timeout:g} s for the next "
        f"attempt ({last or 'no answer'}): a node it needs is gone and no other node can take "
        "its place. Add a node, or raise RayCluster(placement_timeout=...).")


def announce(attempt: int, cause: str, max_restarts: int) -> str:
    return (f"gpulaunch: attempt {attempt} failed ({cause}); stopping every node's ranks and "
            f"restarting the job on every node (attempt {attempt + 1} of {max_restarts})\n")

"""One node of a Ray job, as the caller follows it: its actor, what it last said, what is
in flight.

The caller keeps at most one ``poll`` call in flight per node. An answer brings the node's
``NodeStatus`` and its new files (``mirror.apply``); a node whose agent has ended and whose
files have all arrived is ``done``. A node that does not answer for ``node_lost_timeout`` is
lost: its machine died, its actor was killed, or the network parted.
"""

from __future__ import annotations

import time

from ...common import constants
from ...common.records import NodeState, NodeStatus
from ...common.rundir import RunDir
from . import calls, mirror


class NodeHandle:
    def __init__(self, node_rank: int, actor, info: dict):
        self.node_rank = node_rank
        self.actor = actor
        self.info = info                  # NodeAgent.info(): ip, node_id, host, actor_pid...
        self.cursors: dict = {}
        self.status = NodeStatus(node_rank=node_rank)
        self.done = False
        self.pending = None               # the ObjectRef of the poll in flight
        self.last_answer = time.monotonic()
        self.lost_why: str | None = None

    @property
    def failed(self) -> bool:
        return self.done and self.status.state is not NodeState.SUCCEEDED

    def ask(self) -> None:
        """Send a poll unless one is in flight (or the node is done)."""
        if not self.done and self.pending is None:
            self.pending = calls.call(self.actor.poll, self.cursors)

    def absorb(self, answer: dict, run: RunDir) -> None:
        self.pending = None
        self.last_answer = time.monotonic()
        mirror.apply(run, answer["files"], self.cursors, node_rank=self.node_rank,
                     node=self.info)
        self.status = NodeStatus.from_data(answer["status"]) if answer["status"] else \
            NodeStatus(node_rank=self.node_rank)
        if answer["done"] and not answer["files"]:
            # drained: the agent has ended and every file it left has arrived
            self.done = True
            if answer.get("agent_tail") and not self.status.state.terminal:
                self.status.state = NodeState.AGENT_ERROR
                self.status.error = "the node's agent stopped unexpectedly"
                self.status.traceback = answer["agent_tail"]

    def mark_lost(self, why: str) -> None:
        self.done = True
        self.pending = None
        if self.lost_why is None:
            self.lost_why = why

    def silent_for(self) -> float:
        return time.monotonic() - self.last_answer

    def describe(self, nproc_per_node: int) -> str:
        i, per = self.node_rank, nproc_per_node
        ranks = f"ranks {i * per}-{(i + 1) * per - 1}" if per > 1 else f"rank {i * per}"
        return (f"Ray node {str(self.info.get('node_id', '?'))[:12]}, ip "
                f"{self.info.get('ip', '?')}, host {self.info.get('host', '?')}; {ranks}")


def poll_all(ray, nodes: list[NodeHandle], run: RunDir, *, wait: float,
             lost_after: float) -> None:
    """One round: ask every node, take the answers that come within ``wait`` seconds, and
    declare lost the nodes silent for longer than ``lost_after``."""
    for node in nodes:
        node.ask()
    refs = [n.pending for n in nodes if n.pending is not None]
    if not refs:
        return
    ready, _ = calls.wait(ray, refs, num_returns=len(refs), timeout=wait)
    ready = set(ready)
    for node in nodes:
        ref = node.pending
        if ref is None:
            continue
        if ref not in ready:
            if node.silent_for() > lost_after:
                node.mark_lost(f"its node agent did not answer for {lost_after:g} s")
            continue
        try:
            answer = calls.get(ray, ref)
        except Exception as e:  # noqa: BLE001 - RayActorError, ActorDiedError, NodeDiedError
            node.mark_lost(ray_error_text(e))
            continue
        node.absorb(answer, run)


def ray_error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def stop_all(ray, nodes: list[NodeHandle], *, grace: float) -> None:
    """Stop every node still running, all at once. A node that does not answer within
    ``grace`` while still running is lost."""
    live = [n for n in nodes if n.lost_why is None]
    stops = {n.node_rank: calls.call(n.actor.stop) for n in live}
    for n in live:
        try:
            calls.get(ray, stops[n.node_rank], timeout=grace)
        except (Exception, SystemExit) as e:
            if not n.done:                # it was still running and did not answer
                n.mark_lost(ray_error_text(e))


def drain_all(ray, nodes: list[NodeHandle], run: RunDir) -> None:
    """After ``stop_all``: every node's last files, all nodes' drain rounds in flight together."""
    lost_before = any(n.lost_why is not None for n in nodes)
    draining = [n for n in nodes if n.lost_why is None and not n.done]
    for _ in range(8):                    # after stop() every node's files are final
        if not draining:
            break
        refs = {n.node_rank: calls.call(n.actor.poll, n.cursors) for n in draining}
        left = []
        for n in draining:
            try:
                answer = calls.get(ray, refs[n.node_rank], timeout=constants.RAY_DRAIN_TIMEOUT_S)
            except (Exception, SystemExit) as e:
                if not lost_before and not n.done:
                    n.mark_lost(ray_error_text(e))
                continue
            drained = answer["done"] and not answer["files"]
            n.absorb(answer, run)
            if not drained:
                left.append(n)
        draining = left

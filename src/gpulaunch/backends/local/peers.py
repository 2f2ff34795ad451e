"""Fail-stop across the nodes of a ``gpulaunch run --nnodes N`` job, through the agents' store.

torchrun leaves this to the collectives: when a rank on node 1 dies, node 0's ranks fail only
once they next talk to it, and a rank that is busy elsewhere (data loading, a long local step,
rank 0 writing a checkpoint) goes on, or hangs in its next collective until the NCCL timeout.
Here the node whose ranks failed (restart budget spent) writes its root cause once into the
agents' store (``FAILED_KEY``; the first writer wins, so a later "connection closed" of a
peer never hides it); every other agent polls that key, stops its own ranks and reports the
other node's root cause as its own end, with the same exit code.

Node 0 hosts the store: when it ends with a failure it keeps the store up until every other
node has read the failure (``seen`` keys), bounded by ``LINGER_S``. A node that loses the store
while its ranks run (node 0's agent was killed) stops too, after ``LOST_AFTER_S``.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable

from torch.distributed import TCPStore

from ...common.records import PeerFailure

FAILED_KEY = "gpulaunch/peer/failed"
POLL_S = 0.2
LINGER_S = 10.0            # node 0 keeps its store up this long for the others to read it
LOST_AFTER_S = 5.0         # the store unreachable this long while our ranks run: node 0 is gone
COLLATERAL_WAIT_S = 2.0    # our failure looks like a consequence: wait for the peer's cause


def _seen_key(node_rank: int) -> str:
    return f"gpulaunch/peer/seen/{node_rank}"


class PeerWatch:
    """One agent's view of the other nodes' failures (its own client of the agents' store)."""

    def __init__(self, host: str, port: int, node_rank: int, nnodes: int,
                 on_peer_failure: Callable[[PeerFailure], None]):
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.where = f"{host}:{port}"
        self.on_peer_failure = on_peer_failure
        self.peer: PeerFailure | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._publishing = threading.Event()   # our own failure is being reported: no signal
        self._store = TCPStore(host, port, None, False, datetime.timedelta(seconds=30),
                               wait_for_workers=False)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gpulaunch-peers")

    def start(self) -> "PeerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _read(self) -> PeerFailure | None:
        with self._lock:
            if not self._store.check([FAILED_KEY]):
                return None
            return PeerFailure.from_json(self._store.get(FAILED_KEY).decode())

    def _loop(self) -> None:
        unreachable_since = None
        while not self._stop.wait(POLL_S):
            try:
                failure = self._read()
                unreachable_since = None
            except Exception:  # noqa: BLE001 - the store's server (node 0's agent) went away
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if self.node_rank == 0 or now - unreachable_since < LOST_AFTER_S:
                    continue
                failure = PeerFailure(
                    node_rank=0, rank=-1, exit_code=None, host=self.where.rsplit(":", 1)[0],
                    summary=f"node 0's agent stopped answering (its store at {self.where} is "
                            f"gone for {LOST_AFTER_S:g} s): it was killed, or its host is down")
            if failure is None or failure.node_rank == self.node_rank:
                continue
            self.peer = failure
            self._mark_seen()
            if not (self._stop.is_set() or self._publishing.is_set()):
                self.on_peer_failure(failure)
            return

    def _mark_seen(self) -> None:
        try:
            with self._lock:
                self._store.set(_seen_key(self.node_rank), "1")
        except Exception:  # noqa: BLE001 - node 0 already gone: nothing to tell it
            pass

    def publish(self, failure: PeerFailure, *, collateral: bool = False) -> PeerFailure:
        """Tell the other nodes that ours failed; returns the failure that stands (an earlier
        one of another node wins). ``collateral``: our ranks only saw a peer vanish, so give
        the peer's own report a moment to arrive first."""
        self._publishing.set()
        if collateral:
            deadline = time.monotonic() + COLLATERAL_WAIT_S
            while self.peer is None and time.monotonic() < deadline:
                time.sleep(POLL_S / 2)
        self._stop.set()
        if self.peer is not None:
            return self.peer
        try:
            with self._lock:
                stood = self._store.compare_set(FAILED_KEY, "", failure.to_json())
            first = PeerFailure.from_json(bytes(stood).decode())
        except Exception:  # noqa: BLE001 - node 0 is gone; our own failure is all we know
            return failure
        if first.node_rank != self.node_rank:
            self.peer = first
        return first

    def linger(self) -> None:
        """Node 0, ending with a failure: keep the store up until the others have read it."""
        self._stop.set()
        if self.node_rank != 0:
            return
        told = self.peer.node_rank if self.peer is not None else None
        keys = [_seen_key(n) for n in range(1, self.nnodes) if n != told]
        if not keys:
            return
        try:
            with self._lock:
                self._store.wait(keys, datetime.timedelta(seconds=LINGER_S))
        except Exception:  # noqa: BLE001 - a node that is already gone never acknowledges
            pass


def watch(host: str, port: int, node_rank: int, nnodes: int, on_peer_failure) -> PeerWatch:
    return PeerWatch(host, port, node_rank, nnodes, on_peer_failure).start()


def own_failure(run, attempt: int, exits: dict, node_rank: int) -> tuple[PeerFailure, bool]:
    """This node's root cause, for the others; and whether it looks like a consequence only
    (every rank failed on a vanished peer)."""
    import socket

    from ...caller.collect import rank_failures
    from ...caller.outcome import root_cause
    root = root_cause(rank_failures(run, attempt, exits))
    return (PeerFailure(node_rank=node_rank, rank=root.rank, exit_code=root.exit_code,
                        summary=root.summary(), host=socket.gethostname(),
                        run_dir=str(run.path)), root.priority == 2)

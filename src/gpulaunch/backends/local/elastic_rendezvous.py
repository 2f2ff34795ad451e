"""``gpulaunch run --nnodes MIN:MAX``: torchrun's elastic rendezvous, from torch itself.

Membership is torch's ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend`` (the
``--rdzv-backend c10d`` of torchrun): MIN to MAX nodes join a round, get their node ranks from
it, keep it alive by heartbeats, and a node that joins later waits in its wait list, which the
agent's monitor loop polls (``num_nodes_waiting``) to restart the ranks with the new world size.
A node that dies stops heartbeating and is dropped from the next round after
``keep_alive_interval * keep_alive_max_attempt`` seconds; the round completes once MIN nodes are
in and ``last_call_timeout`` has passed (or MAX are in).

Its store is hosted as torchrun hosts it: by the first node started on the endpoint's host
(that node must stay up for the job's life), the others are clients. What differs from
torch's own handler is only the ranks' store: as on the fixed path (``rendezvous.py``), each
round gets a fresh one, hosted by the round's node 0 on the address this node is reached at
and announced in the round's keys, so that restarted ranks never read a dead group's
addresses; and the round's other nodes start their ranks only once node 0 has forked its own.
"""

from __future__ import annotations

import datetime
import os
import socket

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from ...errors import LaunchError
from .rendezvous import BoundStaticRendezvous

STORE_READ_TIMEOUT_S = 60.0        # torchrun's c10d read_timeout
_RANK_STORE_KEY = "gpulaunch/rank_store"
_STARTED_KEY = "gpulaunch/ranks_started"


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # never past a listener
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(sock: socket.socket, timeout: datetime.timedelta) -> TCPStore:
    """A store server on an already bound socket (the address we chose, never all of them)."""
    args = (sock.getsockname()[0], sock.getsockname()[1], None, True, timeout)
    kwargs = dict(wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
    try:
        return TCPStore(*args, **kwargs)
    except NotImplementedError:     # torch < 2.8: only the classic store adopts a socket
        return TCPStore(*args, **kwargs, use_libuv=False)


class ElasticRendezvous(RendezvousHandler):
    def __init__(self, *, master_addr: str, port: int, advertise: str, min_nodes: int,
                 max_nodes: int, run_id: str, join_timeout: float,
                 last_call_timeout: float = 30.0, keep_alive_interval: float = 5.0,
                 keep_alive_max_attempt: int = 3):
        self.endpoint = f"{master_addr}:{port}"
        self.port = port
        self.advertise = advertise
        self.join_timeout = join_timeout
        timeout = datetime.timedelta(seconds=STORE_READ_TIMEOUT_S)
        self._listener = None
        try:         # the endpoint is on this host and nobody serves it yet: we host it
            self._listener = _listen(socket.gethostbyname(master_addr), port)
        except OSError:
            pass
        self.is_host = self._listener is not None
        if self.is_host:
            self._store = _serve(self._listener, timeout)
        else:
            try:
                self._store = TCPStore(master_addr, port, None, False,
                                       datetime.timedelta(seconds=join_timeout),
                                       wait_for_workers=False)
            except (RuntimeError, TimeoutError) as e:
                raise LaunchError(
                    f"could not reach the rendezvous at {self.endpoint} within {join_timeout:g} "
                    "s (start_timeout): start the first node on that host (it hosts the "
                    "rendezvous), and check --rdzv-endpoint and the network between the nodes "
                    f"({e})") from e
            self._store.set_timeout(timeout)
        backend = C10dRendezvousBackend(self._store, run_id)
        self.handler = DynamicRendezvousHandler.from_backend(
            run_id, self._store, backend, min_nodes, max_nodes, local_addr=advertise,
            timeout=RendezvousTimeout(join=datetime.timedelta(seconds=join_timeout),
                                      last_call=datetime.timedelta(seconds=last_call_timeout)),
            keep_alive_interval=keep_alive_interval,
            keep_alive_max_attempt=keep_alive_max_attempt)
        self.group_rank: int | None = None
        self.nnodes = 0
        self._round_store = None
        self._rank_store = None           # this round's store for the ranks (group rank 0)
        self._rank_listener = None

    def get_backend(self) -> str:
        return "c10d"

    @property
    def use_agent_store(self) -> bool:
        return True                       # ranks are clients of the round's rank store

    def next_rendezvous(self) -> RendezvousInfo:
        # torch's handler would keep one store for the ranks of every round; we make our own
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        try:
            info = self.handler.next_rendezvous()
        except RendezvousClosedError as e:
            raise LaunchError(f"the elastic rendezvous at {self.endpoint} is closed: the job "
                              "ended on another node (it finished, or its ranks failed past "
                              "--max-restarts); see that node's output") from e
        except Exception as e:
            raise LaunchError(f"the elastic rendezvous at {self.endpoint} failed "
                              f"({type(e).__name__}: {e}); if the node hosting it (the first "
                              "started on that host) ended, the job cannot go on without "
                              "it") from e
        finally:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        store, rank, world = info.store, info.rank, info.world_size
        if rank == 0:
            listener = _listen(self.advertise, 0)
            rank_store = _serve(listener, datetime.timedelta(seconds=STORE_READ_TIMEOUT_S))
            # drop the previous round's store only now: the new port can never equal it
            self._rank_store, self._rank_listener = rank_store, listener
            store.set(_RANK_STORE_KEY, f"{self.advertise}|{listener.getsockname()[1]}")
        host, _, port = store.get(_RANK_STORE_KEY).decode().rpartition("|")
        self._round_store, self.group_rank, self.nnodes = store, rank, world
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo(host, int(port)))

    def before_starting_ranks(self) -> None:
        """Not the round's node 0: wait until it has forked all of its ranks (see
        ``BoundStaticRendezvous``: no rank store connection may arrive while it forks)."""
        if self.group_rank:
            self._round_store.wait([_STARTED_KEY],
                                   datetime.timedelta(seconds=self.join_timeout))

    def after_starting_ranks(self) -> None:
        if self.group_rank == 0:
            self._round_store.set(_STARTED_KEY, "1")

    def is_closed(self) -> bool:
        return self.handler.is_closed()

    def set_closed(self) -> None:
        self.handler.set_closed()

    def num_nodes_waiting(self) -> int:
        try:
            return self.handler.num_nodes_waiting()
        except Exception as e:
            raise LaunchError(
                f"lost the elastic rendezvous at {self.endpoint} ({type(e).__name__}: {e}): "
                "the node hosting it (the first started on that host) ended or is "
                "unreachable; the job cannot go on without it") from e

    def get_run_id(self) -> str:
        return self.handler.get_run_id()

    def shutdown(self) -> bool:
        """The job is over on this node (not a signal): close the rendezvous, as torchrun."""
        try:
            return self.handler.shutdown()
        except Exception:  # noqa: BLE001 - the host already ended: nothing to close
            return False


def make(placement, *, node_rank: int, port: int, run_id: str, join_timeout: float):
    """The node's rendezvous: the fixed path's static one, or the elastic one (MIN < MAX)."""
    if placement.elastic:
        advertise = placement.bind_host
        if advertise in ("0.0.0.0", "::", ""):
            advertise = socket.getfqdn()
        return ElasticRendezvous(
            master_addr=placement.master_addr, port=placement.master_port, advertise=advertise,
            min_nodes=placement.min_nodes, max_nodes=placement.nnodes, run_id=run_id,
            join_timeout=join_timeout, last_call_timeout=placement.last_call_timeout,
            keep_alive_interval=placement.keep_alive_interval,
            keep_alive_max_attempt=placement.keep_alive_max_attempt)
    return BoundStaticRendezvous(
        bind_host=placement.bind_host, port=port,
        connect_host=placement.master_addr, node_rank=node_rank, nnodes=placement.nnodes,
        run_id=run_id, join_timeout=join_timeout)

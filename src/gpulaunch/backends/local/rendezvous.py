"""A static rendezvous whose store listens only where we say (loopback for one host).

torchelastic's own static rendezvous creates a ``TCPStore`` that listens on every interface.
On a single host nothing needs to be reachable from outside, so we bind the listening socket
ourselves (127.0.0.1, port 0: the kernel picks a free port atomically, so two runs can never
race for the same port) and hand its file descriptor to ``TCPStore(master_listen_fd=...)``.
Ranks then join an agent store as clients (``TORCHELASTIC_USE_AGENT_STORE=True``), so no rank
opens a store server of its own.

Each rendezvous round (the first start and every restart) gets a *fresh* store for the ranks:
``init_process_group`` writes its keys (gloo/NCCL addresses) at fixed names, so ranks of a
restarted group reading one store would find the dead group's addresses and hang connecting to
them. torch's env:// code assumes exactly this ("we create a new TCPStore for every retry").
The agents keep one store of their own for the whole run; node 0 publishes each round's rank
store port in it for the other nodes.
"""

from __future__ import annotations

import datetime
import socket

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from ...common.constants import RENDEZVOUS_TIMEOUT_S
from . import rendezvous_wait


class BoundStaticRendezvous(RendezvousHandler):
    def __init__(self, *, bind_host: str, port: int, node_rank: int, nnodes: int, run_id: str,
                 connect_host: str | None = None, timeout: float = RENDEZVOUS_TIMEOUT_S,
                 join_timeout: float | None = None):
        self.bind_host = bind_host
        self.connect_host = connect_host or bind_host
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.run_id = run_id
        self.timeout = datetime.timedelta(seconds=timeout)
        # how long every node may take to join a round (start_timeout); then the missing
        # nodes are named (rendezvous_wait)
        self.join_timeout = join_timeout if join_timeout is not None else timeout
        self._listener: socket.socket | None = None
        self._store = None
        self._rank_store = None        # the current round's store for the ranks (node 0)
        self._rank_listener: socket.socket | None = None
        self._round = 0
        self.port = port
        if node_rank == 0:
            self._listener = self._listen(port)
            self.port = self._listener.getsockname()[1]

    def _listen(self, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.bind_host, port))
        sock.listen(512)
        return sock

    def _serve(self, sock: socket.socket, world: int | None):
        args = (self.connect_host, sock.getsockname()[1], world, True, self.timeout)
        kwargs = dict(wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
        try:
            return TCPStore(*args, **kwargs)
        except NotImplementedError:
            # torch < 2.8: the libuv store cannot adopt a listening socket (the environments
            # of LLM Foundry / Axolotl pin such torch); the classic store can.
            return TCPStore(*args, **kwargs, use_libuv=False)

    def get_backend(self) -> str:
        return "gpulaunch-static"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            if self._listener is not None:
                self._store = self._serve(self._listener, self.nnodes)
            else:
                self._store = rendezvous_wait.connect(self.connect_host, self.port, self.nnodes,
                                                      self.timeout, self.join_timeout)
        key = f"gpulaunch/rank_store_port/{self._round}"
        # Forking ranks while a store thread accepts a connection can deadlock a rank (see
        # GpulaunchAgent._fork_workers_behind_a_gate): node 0 forks only once every node's agent
        # has connected, and the other nodes start their ranks (which connect to node 0's rank
        # store) only once node 0 has forked all of its own (``before_starting_ranks`` /
        # ``after_starting_ranks``, called by the agent around its start of the ranks).
        self._store.set(f"gpulaunch/joined/{self._round}/{self.node_rank}", "1")
        if self.node_rank == 0:
            rendezvous_wait.all_joined(self._store, self._round, self.nnodes, self.join_timeout,
                                       f"{self.connect_host}:{self.port}")
            listener = self._listen(0)
            rank_store = self._serve(listener, None)
            # drop the previous round's store only now: the new port can never equal it
            self._rank_store, self._rank_listener = rank_store, listener
            rank_port = listener.getsockname()[1]
            self._store.set(key, str(rank_port))
        else:
            rank_port = int(self._store.get(key))
        self._round += 1
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, self.node_rank, self.nnodes,
                              RendezvousStoreInfo(self.connect_host, rank_port))

    def before_starting_ranks(self) -> None:
        """Nodes > 0: wait until node 0 has started all of this round's ranks."""
        if self.node_rank != 0 and self._store is not None:
            self._store.wait([f"gpulaunch/ranks_started/{self._round - 1}"])

    def after_starting_ranks(self) -> None:
        """Node 0: this round's ranks are all forked; the other nodes may start theirs."""
        if self.node_rank == 0 and self._store is not None:
            self._store.set(f"gpulaunch/ranks_started/{self._round - 1}", "1")

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        """Another node has joined the next round (its ranks failed and it restarts): the
        agent restarts ours too (torchelastic asks this of every healthy group), so a restart
        of one node is a restart of the whole job."""
        if self.nnodes == 1 or self._store is None:
            return 0
        return sum(1 for n in range(self.nnodes) if n != self.node_rank and
                   self._store.check([f"gpulaunch/joined/{self._round}/{n}"]))

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True

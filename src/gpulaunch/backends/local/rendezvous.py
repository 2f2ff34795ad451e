"""A static rendezvous whose store listens only where we say (loopback for one host).

torchelastic's own static rendezvous creates a ``TCPStore`` that listens on every interface.
On a single host nothing needs to be reachable from outside, so we bind the listening socket
ourselves (127.0.0.1, port 0: the kernel picks a free port atomically, so two runs can never
race for the same port) and hand its file descriptor to ``TCPStore(master_listen_fd=...)``.
Ranks then join this agent store as clients (``TORCHELASTIC_USE_AGENT_STORE=True``), so no rank
opens a store server of its own.
"""

from __future__ import annotations

import datetime
import socket

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo,
                                                  RendezvousStoreInfo)


class BoundStaticRendezvous(RendezvousHandler):
    def __init__(self, *, bind_host: str, port: int, node_rank: int, nnodes: int, run_id: str,
                 connect_host: str | None = None, timeout: float = 600.0):
        self.bind_host = bind_host
        self.connect_host = connect_host or bind_host
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.run_id = run_id
        self.timeout = datetime.timedelta(seconds=timeout)
        self._listener: socket.socket | None = None
        self._store = None
        self.port = port
        if node_rank == 0:
            family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind_host, port))
            sock.listen(512)
            self._listener = sock
            self.port = sock.getsockname()[1]

    def get_backend(self) -> str:
        return "gpulaunch-static"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            if self._listener is not None:
                self._store = TCPStore(self.connect_host, self.port, self.nnodes, True,
                                       self.timeout, wait_for_workers=False, multi_tenant=True,
                                       master_listen_fd=self._listener.fileno())
            else:
                self._store = TCPStore(self.connect_host, self.port, self.nnodes, False,
                                       self.timeout)
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, self.node_rank, self.nnodes,
                              RendezvousStoreInfo(self.connect_host, self.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True

"""The rendezvous's two waits, bounded by ``start_timeout`` and named when they expire: node 0
waiting for the other nodes to join (which ones never came), and a node connecting to node 0's
store (which address it could not reach). Without them a node that never starts kept the job
waiting for the store's fixed timeout (600 s) and the error said only "timeout"."""

from __future__ import annotations

import datetime
import time

from torch.distributed import TCPStore

from ...errors import LaunchError

_POLL_S = 0.2


def all_joined(store, round_: int, nnodes: int, timeout: float, endpoint: str) -> None:
    """Node 0: wait until every node's agent joined round ``round_``; else LaunchError naming
    the nodes that did not."""
    keys = {n: f"gpulaunch/joined/{round_}/{n}" for n in range(nnodes)}
    deadline = time.monotonic() + timeout
    while True:
        missing = [n for n, key in keys.items() if not store.check([key])]
        if not missing:
            return
        if time.monotonic() >= deadline:
            nodes = ", ".join(str(n) for n in missing)
            raise LaunchError(
                f"node{'s' if len(missing) > 1 else ''} {nodes} of {nnodes} did not join the "
                f"rendezvous at {endpoint} within {timeout:g} s (start_timeout). Start "
                f"`gpulaunch run ... --node-rank {missing[0]}` there with the same --nnodes, "
                "--master-addr and --master-port, and check that it can reach this host on that "
                "port (a firewall, or the wrong address)")
        time.sleep(_POLL_S)


def connect(host: str, port: int, nnodes: int, store_timeout: datetime.timedelta,
            join_timeout: float) -> TCPStore:
    """A node > 0: node 0's store as a client, trying for ``join_timeout`` seconds."""
    try:
        store = TCPStore(host, port, nnodes, False, datetime.timedelta(seconds=join_timeout))
    except (RuntimeError, TimeoutError) as e:      # DistNetworkError / DistStoreError
        raise LaunchError(
            f"could not reach node 0's rendezvous store at {host}:{port} within {join_timeout:g} "
            f"s (start_timeout): start node 0 (--node-rank 0) first or together, and check "
            f"--master-addr / --master-port and the network between the nodes ({e})") from e
    store.set_timeout(store_timeout)
    return store

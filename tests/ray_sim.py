"""A real local Ray cluster of simulated nodes on this host, for the Ray test modules.

Each "node" is a Ray raylet with its own CPU slots (``ray.cluster_utils.Cluster``); gloo runs
between them as between machines. Short socket paths (``RAY_TMPDIR``: the AF_UNIX limit), no
token file in ~/.ray, and every node's gpulaunch run directories under ``<base>/nodes-home``.
"""

from __future__ import annotations

import contextlib
import os

_SAVED = ("RAY_TMPDIR", "RAY_AUTH_MODE", "GPULAUNCH_HOME")


@contextlib.contextmanager
def simulated_cluster(base, nodes: int, slots: int, tag: str):
    """Start ``nodes`` simulated nodes of ``slots`` CPUs, connect this process, yield the
    ``Cluster``; shut everything down and restore the environment after. ``tag`` keeps two
    modules' socket folders apart."""
    import ray
    from ray.cluster_utils import Cluster
    tmpdir = f"/tmp/{tag}-{os.getpid()}"
    os.makedirs(tmpdir, exist_ok=True)
    saved = {k: os.environ.get(k) for k in _SAVED}
    os.environ.update(RAY_TMPDIR=tmpdir, RAY_AUTH_MODE="disabled",
                      GPULAUNCH_HOME=str(base / "nodes-home"))
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": slots, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            c.add_node(num_cpus=slots)
        ray.init(address=c.address)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

"""Where this node sits in a multi-node job, from flags or the cluster's environment. Pure: it
reads a mapping (``os.environ``) and the parsed flags, and starts nothing.

Sources, first match wins (``ClusterEnv.source`` says which was used, and ``gpulaunch run``
prints it):

1. flags, as torchrun takes them: ``--nnodes N --node-rank R --master-addr A --master-port P``,
   or ``--rdzv-endpoint A:P``, ``--rdzv-id ID``;
2. torchrun's own environment defaults (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
   ``PET_MASTER_PORT``, ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``): what the Kubernetes training
   operator sets for a PyTorchJob with ``nprocPerNode``;
3. Slurm, inside an ``srun`` step: ``SLURM_NNODES``, ``SLURM_NODEID``, the first host of
   ``SLURM_JOB_NODELIST`` as the master, ``SLURM_JOB_ID`` as the rendezvous id;
4. a PyTorchJob without ``nprocPerNode``: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (the
   number of pods = nodes) and ``RANK`` (this pod's index), read only when no ``LOCAL_RANK`` is
   set (inside a rank they mean ranks, not nodes).

Nothing found: one node, as before.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from ..errors import ConfigurationError

DEFAULT_MASTER_PORT = 29500           # torchrun's


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    rdzv_id: str = "none"             # torchrun's default
    source: str = "single node"
    # ``--nnodes MIN:MAX`` (MIN < MAX): an elastic job of MIN to ``nnodes`` nodes, node ranks
    # assigned by the rendezvous at each round (``node_rank`` is then meaningless); 0: fixed
    min_nodes: int = 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes

    def describe(self) -> str:
        if self.elastic:
            return (f"elastic, {self.min_nodes} to {self.nnodes} nodes (node ranks from the "
                    f"rendezvous), rendezvous {self.master_addr}:{self.master_port}, id "
                    f"{self.rdzv_id!r} (from {self.source})")
        return (f"node {self.node_rank} of {self.nnodes}, master {self.master_addr}:"
                f"{self.master_port}, rendezvous id {self.rdzv_id!r} (from {self.source})")


# ----------------------------------------------------------------------------- Slurm host lists
def parse_nodelist(text: str) -> list[str]:
    """Expand Slurm's compressed host list: ``node[01-03,07],gpu-a[1-2]-ib,login`` ->
    ``node01 node02 node03 node07 gpu-a1-ib gpu-a2-ib login``. Zero padding is kept; several
    bracket groups in one name multiply out (``r[1-2]n[1-2]``)."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm host list {text!r}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in Slurm host list {text!r}")
    items.append(cur)
    return [i for i in (s.strip() for s in items) if i]


def _expand(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if m is None:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand(rest) if rest else [""]
    out = []
    for part in ranges.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in Slurm host list item {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out.extend(f"{prefix}{n:0{width}d}{t}" for t in tails)
    return out


# ----------------------------------------------------------------------------- detection
def split_endpoint(endpoint: str, default_port: int = DEFAULT_MASTER_PORT) -> tuple[str, int]:
    """``host:port``, ``host``, ``[::1]:port`` -> (host, port)."""
    endpoint = endpoint.strip()
    m = re.match(r"^\[([^\]]+)\](?::(\d+))?$", endpoint)
    if m:
        return m.group(1), int(m.group(2) or default_port)
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, default_port
    if not port.isdigit() or not host:
        raise ConfigurationError(f"--rdzv-endpoint {endpoint!r}: use HOST:PORT")
    return host, int(port)


def parse_nnodes_range(value) -> tuple[int, int] | None:
    """``--nnodes 2`` -> (2, 2); torchrun's ``MIN:MAX`` -> (MIN, MAX), 1 <= MIN <= MAX."""
    if value is None:
        return None
    text = str(value).strip()
    lo, sep, hi = text.partition(":")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ConfigurationError(f"--nnodes {text!r}: give a number of nodes (--nnodes 2) or "
                                 "a range MIN:MAX (--nnodes 1:4)")
    low, high = int(lo), int(hi if sep else lo)
    if low < 1:
        raise ConfigurationError(f"--nnodes {text}: needs at least 1 node"
                                 + (" (MIN:MAX with MIN >= 1, e.g. --nnodes 1:4)" if sep else ""))
    if high < low:
        raise ConfigurationError(f"--nnodes {text}: MIN is larger than MAX; give MIN:MAX with "
                                 f"MIN <= MAX (--nnodes {high}:{low})")
    return low, high


def parse_nnodes(value) -> int | None:
    """``--nnodes 2`` or torchrun's ``2:2``: the fixed count (a range: its MAX)."""
    found = parse_nnodes_range(value)
    return None if found is None else found[1]


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigurationError(f"{name}={env[name]!r} is not a number") from None


def detect(env: Mapping[str, str], *, nnodes=None, node_rank: int | None = None,
           master_addr: str | None = None, master_port: int | None = None,
           rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> ClusterEnv:
    """This node's place in the job (see the module docstring for the order of sources)."""
    n = parse_nnodes_range(nnodes)
    if n is None and env.get("PET_NNODES"):
        return _from_flags(parse_nnodes_range(env["PET_NNODES"]),
                           _int(env, "PET_NODE_RANK") if env.get("PET_NODE_RANK") else None,
                           env.get("PET_MASTER_ADDR"),
                           _int(env, "PET_MASTER_PORT") if env.get("PET_MASTER_PORT") else None,
                           env.get("PET_RDZV_ENDPOINT"), env.get("PET_RDZV_ID"),
                           "torchrun's PET_* environment")
    if n is None and env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") is not None \
            and env.get("SLURM_NNODES"):
        return _from_slurm(env, master_port)
    if n is None and all(env.get(k) for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK")) \
            and "LOCAL_RANK" not in env:
        world = _int(env, "WORLD_SIZE")
        port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_MASTER_PORT
        return _checked(ClusterEnv(world, _int(env, "RANK"), env["MASTER_ADDR"], port,
                                   rdzv_id or "none", "MASTER_ADDR/WORLD_SIZE/RANK "
                                   "(a PyTorchJob: one node per pod)"))
    return _from_flags(n or (1, 1), node_rank, master_addr, master_port, rdzv_endpoint, rdzv_id,
                       "flags")


def _from_flags(nodes: tuple[int, int], node_rank, master_addr, master_port, endpoint, rdzv_id,
                source) -> ClusterEnv:
    low, n = nodes
    if endpoint:
        host, port = split_endpoint(endpoint, master_port or DEFAULT_MASTER_PORT)
        if master_addr and master_addr != host:
            raise ConfigurationError(f"--master-addr {master_addr} and --rdzv-endpoint "
                                     f"{endpoint} name different hosts; give one of them")
        if master_port and master_port != port:
            raise ConfigurationError(f"--master-port {master_port} and --rdzv-endpoint "
                                     f"{endpoint} name different ports; give one of them")
        master_addr, master_port = host, port
    if low < n:
        return _elastic(low, n, node_rank, master_addr, master_port, rdzv_id, source)
    if n == 1:
        return ClusterEnv(rdzv_id=rdzv_id or "none", source=source if rdzv_id else "single node")
    if node_rank is None:
        raise ConfigurationError(f"--nnodes {n} needs --node-rank (0 to {n - 1}) on each node")
    if not master_addr:
        raise ConfigurationError(f"--nnodes {n} needs --master-addr (node 0's address, the same "
                                 "on every node) or --rdzv-endpoint HOST:PORT")
    return _checked(ClusterEnv(n, node_rank, master_addr, master_port or DEFAULT_MASTER_PORT,
                               rdzv_id or "none", source))


def _elastic(low, high, node_rank, master_addr, master_port, rdzv_id, source) -> ClusterEnv:
    """``--nnodes MIN:MAX``: every node runs the same command; torch's dynamic rendezvous at
    the endpoint admits MIN to MAX nodes and numbers them at each round."""
    if node_rank is not None and source == "flags":    # (an operator's PET_NODE_RANK: unused)
        raise ConfigurationError(
            f"--nnodes {low}:{high} assigns node ranks at the rendezvous (they change as nodes "
            f"come and go): drop --node-rank {node_rank}, every node runs the same command")
    if not master_addr:
        raise ConfigurationError(
            f"--nnodes {low}:{high} needs the rendezvous endpoint, the same on every node: "
            "--rdzv-endpoint HOST:PORT (or --master-addr HOST --master-port PORT); the node "
            "started first on HOST hosts the rendezvous")
    return _checked(ClusterEnv(high, 0, master_addr, master_port or DEFAULT_MASTER_PORT,
                               rdzv_id or "none", source, min_nodes=low))


def _from_slurm(env: Mapping[str, str], master_port: int | None) -> ClusterEnv:
    nodes = _int(env, "SLURM_NNODES")
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_STEP_NUM_TASKS")
    if tasks and int(tasks) != nodes:
        raise ConfigurationError(
            f"srun started {tasks} tasks on {nodes} node(s); gpulaunch run starts every rank "
            "of a node itself and needs one task per node: srun --ntasks-per-node=1 "
            "gpulaunch run ...")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigurationError("Slurm job without SLURM_JOB_NODELIST: pass --master-addr")
    try:
        hosts = parse_nodelist(nodelist)
    except ValueError as e:
        raise ConfigurationError(f"{e}; pass --master-addr") from None
    port = master_port or (_int(env, "MASTER_PORT") if env.get("MASTER_PORT")
                           else DEFAULT_MASTER_PORT)
    return _checked(ClusterEnv(nodes, _int(env, "SLURM_NODEID"), hosts[0], port,
                               env["SLURM_JOB_ID"], "Slurm (SLURM_NNODES, SLURM_NODEID, "
                               "SLURM_JOB_NODELIST, SLURM_JOB_ID)"))


def _checked(c: ClusterEnv) -> ClusterEnv:
    if c.nnodes < 1:
        raise ConfigurationError(f"{c.source}: {c.nnodes} nodes; needs at least 1")
    if not 0 <= c.node_rank < c.nnodes:
        raise ConfigurationError(f"{c.source}: node rank {c.node_rank} is outside 0..."
                                 f"{c.nnodes - 1} for {c.nnodes} nodes")
    if not 0 < c.master_port < 65536:
        raise ConfigurationError(f"{c.source}: master port {c.master_port} is not a TCP port")
    return c

"""``gpulaunch run`` across nodes: where the job's nodes come from.

Either every node launches the command itself (torchrun's flags ``--nnodes``, ``--node-rank``,
``--master-addr``..., or what Slurm / a PyTorchJob put in the environment: ``placement``), or
one caller places the whole job on a Ray cluster (``--cluster ADDRESS``: ``on_ray``).
"""

from __future__ import annotations

import os
import sys

from . import errors
from .common.records import Entry


def add_arguments(p) -> None:
    """The flags that say where the job's other nodes are."""
    p.add_argument("--working-dir", default=None, metavar="DIR",
                   help="with --cluster: ship DIR to every node through Ray (runtime_env "
                   "working_dir); the ranks run from its copy, so the script's path is taken "
                   "relative to DIR. Without it, every node must have the script at the same "
                   "absolute path (a shared filesystem or the same image)")
    g = p.add_argument_group("several nodes (torchrun's flags; under Slurm or a Kubernetes "
                             "PyTorchJob they are read from the environment)")
    g.add_argument("--nnodes", default=None, help="number of nodes, each running this command "
                   "(default: 1, or what Slurm / the PyTorchJob environment says); MIN:MAX: "
                   "elastic, the job goes on with MIN to MAX nodes as nodes are lost or join "
                   "(needs --rdzv-endpoint; node ranks come from the rendezvous)")
    g.add_argument("--node-rank", "--node_rank", type=int, default=None, help="this node's index, 0..nnodes-1")
    g.add_argument("--master-addr", "--master_addr", default=None, help="node 0's address (the same everywhere)")
    g.add_argument("--master-port", "--master_port", type=int, default=None, help="node 0's rendezvous port "
                   "(default: 29500)")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT, instead of --master-addr "
                   "and --master-port")
    g.add_argument("--rdzv-id", "--rdzv_id", default=None, help="job id, the same on every node (Slurm: "
                   "SLURM_JOB_ID)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", default=None, help="c10d or static: a fixed "
                   "--nnodes runs gpulaunch's own static rendezvous on node 0, --nnodes MIN:MAX "
                   "torch's c10d dynamic rendezvous; etcd is refused")
    g.add_argument("--listen-addr", default=None, help="address node 0's store listens on "
                   "(default: this host's address on the route to the master; 0.0.0.0 only "
                   "if you give it)")


def placement(args):
    """This node's place in a multi-node job, or None for one node. Also picks the
    collectives' interface from the route to the master, and says what it chose."""
    from .caller import cluster_env, netroute
    from .common.records import NodePlacement
    c = cluster_env.detect(os.environ, nnodes=args.nnodes, node_rank=args.node_rank,
                           master_addr=args.master_addr, master_port=args.master_port,
                           rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    if c.elastic:
        return _elastic_placement(args, c)
    if not c.multi_node:
        if c.rdzv_id == "none":
            return None
        # One node that still has a job id (srun -N1, --rdzv-id): the ranks rendezvous on this
        # host's loopback as usual, under the job's id (launch.json, TORCHELASTIC_RUN_ID).
        print(f"gpulaunch: one node, rendezvous id {c.rdzv_id!r} (from {c.source}); ranks "
              "rendezvous on this host", file=sys.stderr)
        return NodePlacement(rdzv_id=f"gpulaunch-{c.rdzv_id}")
    local_ip = netroute.local_ip_towards(c.master_addr, c.master_port)
    bind = args.listen_addr or local_ip
    chosen = _collectives_interface(local_ip)
    if c.node_rank == 0 and netroute.resolve(c.master_addr).startswith("127.") and \
            not c.master_addr.startswith("127.") and c.master_addr != "localhost":
        print(f"gpulaunch: warning: the master address {c.master_addr} resolves to a loopback "
              "address on this host (/etc/hosts); other machines cannot reach it there. Pass "
              "--master-addr with node 0's IP.", file=sys.stderr)
    print(f"gpulaunch: {c.describe()}; {'store listens on ' + bind if c.node_rank == 0 else ''}"
          f"{'; ' if c.node_rank == 0 else ''}this host reaches the master from {local_ip}; "
          f"{', '.join(chosen) or 'collectives pick their interface'}", file=sys.stderr)
    return NodePlacement(node_rank=c.node_rank, nnodes=c.nnodes, bind_host=bind,
                         master_addr=c.master_addr, master_port=c.master_port,
                         rdzv_id=f"gpulaunch-{c.rdzv_id}", stop_on_peer_failure=True)


# torchrun's --rdzv-conf keys that tune its dynamic rendezvous (--nnodes MIN:MAX)
_ELASTIC_CONF = {"last_call_timeout": float, "keep_alive_interval": float,
                 "keep_alive_max_attempt": int}


def _elastic_placement(args, c):
    """``--nnodes MIN:MAX``: torch's dynamic rendezvous (c10d backend) at the endpoint; the
    node that starts first on the endpoint's host hosts its store, as torchrun's does."""
    from .caller import netroute
    from .common.records import NodePlacement
    if getattr(args, "rdzv_backend", None) == "static":
        raise errors.ConfigurationError(
            f"--rdzv-backend static needs a fixed --nnodes; --nnodes {c.min_nodes}:{c.nnodes} "
            "runs torch's c10d dynamic rendezvous (--rdzv-backend c10d, or leave it out)")
    local_ip = netroute.local_ip_towards(c.master_addr, c.master_port)
    chosen = _collectives_interface(local_ip)
    conf = {}
    for item in filter(None, (x.strip() for x in (getattr(args, "tr_rdzv_conf", None)
                                                  or "").split(","))):
        key, _, value = item.partition("=")
        if key in _ELASTIC_CONF:
            try:
                conf[key] = _ELASTIC_CONF[key](value)
            except ValueError:
                raise errors.ConfigurationError(f"--rdzv-conf {key}={value!r}: give a "
                                                "number") from None
            if conf[key] <= 0:
                raise errors.ConfigurationError(f"--rdzv-conf {key}={value}: must be > 0")
    print(f"gpulaunch: {c.describe()}; this host reaches it from {local_ip}; "
          f"{', '.join(chosen) or 'collectives pick their interface'}", file=sys.stderr)
    return NodePlacement(nnodes=c.nnodes, min_nodes=c.min_nodes,
                         bind_host=args.listen_addr or local_ip, master_addr=c.master_addr,
                         master_port=c.master_port, rdzv_id=f"gpulaunch-{c.rdzv_id}", **conf)


def _collectives_interface(local_ip: str) -> list[str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the interface of the route to the master,
    unless set; what was chosen, in words."""
    from .caller import netroute
    ifname = netroute.interface_of(local_ip)
    chosen = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var in os.environ:
            chosen.append(f"{var}={os.environ[var]} (yours)")
        elif ifname:
            os.environ[var] = ifname
            chosen.append(f"{var}={ifname}")
    return chosen


def on_ray(args, opts, entry: Entry, placement):
    """``gpulaunch run --cluster ADDRESS``: the script on a Ray cluster's nodes (one node
    agent per node, as for ``@distributed(remote=True)``)."""
    import dataclasses
    if placement is not None and placement.nnodes > 1:   # one node with a job id is fine
        raise errors.ConfigurationError(
            "--cluster runs the job on a Ray cluster, which places every node itself: drop "
            "--nnodes/--node-rank/--master-addr (those are for launching on each node yourself)")
    if args.working_dir:
        root = os.path.abspath(args.working_dir)
        if not os.path.isdir(root):
            raise errors.ConfigurationError(f"--working-dir {args.working_dir!r} is not a folder")
        env = dict(opts.cluster.runtime_env or {}, working_dir=root)
        opts = dataclasses.replace(opts, cluster=dataclasses.replace(opts.cluster,
                                                                     runtime_env=env))
        if entry.kind == "script":
            rel = os.path.relpath(os.path.abspath(entry.argv[0]), root)
            if rel.startswith(".."):
                raise errors.ConfigurationError(
                    f"script {entry.argv[0]!r} is outside --working-dir {args.working_dir!r}: "
                    "the nodes only get that folder")
            entry = Entry("script", (rel,) + tuple(entry.argv[1:]))
    elif entry.kind == "script":
        entry = Entry("script", (os.path.abspath(entry.argv[0]),) + tuple(entry.argv[1:]))
    return opts, entry

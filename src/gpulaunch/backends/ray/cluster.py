"""Which Ray cluster a run goes to, and how we connect to it (``ray.init`` semantics).

    @distributed(gpus=16, remote=True)                               # RAY_ADDRESS / "auto"
    @distributed(gpus=16, cluster="ray://head:10001")                # Ray Client
    @distributed(gpus=16, cluster=RayCluster(address="auto", runtime_env={"working_dir": "."}))

Address, first match wins: ``RayCluster.address`` (or the string given as ``cluster=``),
``$GPULAUNCH_RAY_ADDRESS``, ``$RAY_ADDRESS``, then "auto" (the cluster this machine belongs to,
found by ``ray start``'s address file). ``"local"`` starts a private single-node Ray instance in
this process, which is what tests and laptops use.

Safe defaults: when gpulaunch starts Ray itself (``"local"``) the dashboard is off and nothing
listens beyond what Ray needs for its own processes. When it joins an existing cluster it
changes nothing there: dashboard and ports are whatever that cluster's ``ray start`` set.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ...errors import ConfigurationError, LaunchError

ADDRESS_ENV = "GPULAUNCH_RAY_ADDRESS"


@dataclasses.dataclass(frozen=True)
class RayCluster:
    """How to reach and use a Ray cluster (``cluster=`` of ``@distributed``).

    address: a Ray address ("auto", "host:6379", "ray://host:10001", "local"); None = from
        the environment (see the module docstring).
    runtime_env: Ray's runtime environment for the ranks' nodes: ``working_dir`` (your code
        next to the notebook), ``pip``, ``env_vars``, ``py_modules``... Local paths only work
        when gpulaunch makes the connection (they are uploaded at ``ray.init``); if you already
        called ``ray.init`` yourself, pass ``runtime_env`` there.
    gpus_per_node: ranks per node; None = every GPU of the largest node (or, on a cluster with
        no GPUs, every CPU of the largest node, one CPU per rank).
    placement_timeout: seconds to wait for the nodes when the cluster has them but they are
        busy with other work. A job the cluster can never hold fails at once, without waiting.
    autoscaling: the cluster can add nodes (Ray autoscaler, KubeRay): skip the "can never hold"
        check and wait up to ``placement_timeout`` for the nodes to appear.
    """

    address: str | None = None
    runtime_env: dict | None = None
    gpus_per_node: int | None = None
    placement_timeout: float = 60.0
    autoscaling: bool = False
    namespace: str | None = None

    def __post_init__(self):
        if self.address is not None and not isinstance(self.address, str):
            raise ConfigurationError(f"RayCluster(address=...) must be a string such as 'auto' "
                                     f"or 'head-node:6379', got {self.address!r}.")
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ConfigurationError("RayCluster(runtime_env=...) must be a dict (Ray's "
                                     "runtime_env: working_dir, pip, env_vars, ...).")
        g = self.gpus_per_node
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ConfigurationError(f"RayCluster(gpus_per_node=...) must be a positive int, "
                                     f"got {g!r}.")
        t = self.placement_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigurationError(f"RayCluster(placement_timeout=...) must be a positive "
                                     f"number of seconds, got {t!r}.")

    @classmethod
    def coerce(cls, value) -> "RayCluster":
        if value is None:
            return cls()
        if isinstance(value, RayCluster):
            return value
        if isinstance(value, str):
            return cls(address=value)
        if isinstance(value, dict):
            return cls(**value)
        raise ConfigurationError(f"cluster= takes a Ray address string or a RayCluster(...), "
                                 f"got {value!r}.")

    def resolved_address(self) -> str:
        return (self.address or os.environ.get(ADDRESS_ENV) or os.environ.get("RAY_ADDRESS")
                or "auto")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigurationError(
            "remote=True runs on a Ray cluster and needs Ray: pip install 'gpulaunch[ray]'.") \
            from None
    return ray


def has_local_paths(runtime_env: dict | None) -> bool:
    if not runtime_env:
        return False
    wd = runtime_env.get("working_dir")
    mods = runtime_env.get("py_modules") or []
    return any(isinstance(p, str) and "://" not in p for p in ([wd] if wd else []) + list(mods)) \
        or any(not isinstance(p, str) for p in mods)


def connect(cluster: RayCluster) -> Any:
    """Connect this process to the cluster (once); return the ``ray`` module."""
    ray = import_ray()
    if ray.is_initialized():
        if has_local_paths(cluster.runtime_env):
            raise ConfigurationError(
                "RayCluster(runtime_env=...) names local paths (working_dir / py_modules), but "
                "this process is already connected to Ray, and Ray uploads local paths only at "
                "ray.init(). Pass runtime_env to your ray.init(...) call instead, or use a URI "
                "(s3://, gs://, https://...zip).")
        return ray
    address = cluster.resolved_address()
    kwargs: dict[str, Any] = {"runtime_env": cluster.runtime_env, "namespace": cluster.namespace,
                              "log_to_driver": True}
    if address == "local":
        # A private instance in this process: no dashboard, nothing for others to reach.
        # address="local" (not None: None makes ray.init attach to $RAY_ADDRESS or the last
        # `ray start` on this machine, possibly another user's). Ray itself turns a loopback
        # _node_ip_address into the host's IP (services.resolve_ip_for_localhost), so the
        # node cannot be bound to 127.0.0.1 from here.
        kwargs.update(include_dashboard=False)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        raise LaunchError(
            f"Could not connect to a Ray cluster at {address!r}: {e}\n"
            f"Start one with `ray start --head` (and `ray start --address=<head>:6379` on the "
            f"other machines), or name it with cluster='<head>:6379' or ${ADDRESS_ENV}. "
            "cluster='local' runs a private single-node Ray here.") from None
    return ray


_ALL_INTERFACES = ("0.0.0.0", "::", "")


def ray_init(address: str | None = None, **kwargs):
    """``ray.init`` the way gpulaunch connects (``databricks.air.ray_init``'s counterpart).

    address: as ``cluster=`` ("auto", "head:6379", "ray://...", "local"); None: from
        $GPULAUNCH_RAY_ADDRESS, $RAY_ADDRESS, else a private local instance.
    Everything else goes to ``ray.init``. Unlike the seed's, no dashboard is opened on all
    interfaces: a local instance starts without one unless ``include_dashboard=True``, which
    then listens on 127.0.0.1 (reach it through an SSH tunnel); ``dashboard_host="0.0.0.0"``
    is refused. Returns what ``ray.init`` returns (its context, with ``dashboard_url``).
    """
    host = kwargs.get("dashboard_host")
    if host is not None and host in _ALL_INTERFACES:
        raise ConfigurationError(
            f"ray_init(dashboard_host={host!r}) would serve Ray's dashboard (which can run "
            "arbitrary jobs) on every network interface. Leave dashboard_host out (127.0.0.1) "
            "and reach it with an SSH tunnel: ssh -L 8265:127.0.0.1:8265 <this host>.")
    ray = import_ray()
    if ray.is_initialized():
        return ray.get_runtime_context()
    resolved = address or os.environ.get(ADDRESS_ENV) or os.environ.get("RAY_ADDRESS") or "local"
    if resolved == "local":
        kwargs.setdefault("include_dashboard", False)
        if kwargs["include_dashboard"]:
            kwargs.setdefault("dashboard_host", "127.0.0.1")
    try:
        ctx = ray.init(address=resolved, **kwargs)
    except ConnectionError as e:
        raise LaunchError(f"Could not connect to a Ray cluster at {resolved!r}: {e}. Start one "
                          "with `ray start --head`, or call ray_init() with no address for a "
                          "private one on this host.") from None
    url = getattr(ctx, "dashboard_url", None)
    if url and not os.environ.get("GPULAUNCH_QUIET"):
        print(f"gpulaunch: Ray dashboard at http://{url}")
    return ctx

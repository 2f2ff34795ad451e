"""Multi-node runs on a Ray cluster (``gpulaunch[ray]``).

``@distributed(gpus=16, remote=True)`` gang-schedules one node agent per node with a placement
group; each agent runs its node's ranks with the single-host backend (``backends/local``).
``ray_launch`` runs a function once, as a Ray program, inside such an allocation.
``ray_launch`` lives in ``ray_launch.py`` (it builds on the decorator); ``ray_init`` in
``cluster.py``. See docs/multi-node.md. Importing this package does not import Ray.
"""

from .cluster import ADDRESS_ENV, RayCluster, ray_init

__all__ = ["RayCluster", "ADDRESS_ENV", "ray_init"]

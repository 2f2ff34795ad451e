"""Multi-node runs on a Ray cluster (``gpulaunch[ray]``).

``@distributed(gpus=16, remote=True)`` gang-schedules one node agent per node with a placement
group; each agent runs its node's ranks with the single-host backend (``backends/local``).
``ray_launch`` runs a function once, as a Ray program, inside such an allocation.
See docs/multi-node.md. Importing this package does not import Ray.
"""

from .cluster import ADDRESS_ENV, RayCluster
from .driver import current_placement_group, ray_launch

__all__ = ["RayCluster", "ADDRESS_ENV", "ray_launch", "current_placement_group"]

"""``ray_launch`` (defined in ``gpulaunch.api``): run a function once, as a Ray program, on an
allocation of the cluster; ``current_placement_group()`` inside it.

    from gpulaunch import ray_launch

    @ray_launch(gpus=16, remote=True)
    def pipeline():
        import ray
        ds = ray.data.range(10_000).map_batches(embed, num_gpus=1, concurrency=16)
        return ds.count()

    pipeline.distributed()          # -> [10000, None, ..., None], as the seed product

Where ``@distributed`` starts one torch rank per GPU, this reserves the same gang of nodes (a
placement group, all nodes or none, refused at once if the cluster can never hold it) and runs
the function a single time, on node 0, with Ray connected. Every Ray task and actor it starts
(Ray Data, Ray Train workers, your own) is placed inside the allocation
(``placement_group_capture_child_tasks``). Without ``remote``/``cluster`` a private Ray on this
host holds the allocation. It goes through the same pipeline as ``@distributed``
(``caller.pipeline.launch``, backend "ray_program": ``RayProgramRun``), so settings, errors,
tracking and ``submit()`` behave the same.
"""

from __future__ import annotations

# The decorator itself is public API: defined in gpulaunch/api.py, named here as before.
from ...api import RayLaunchFunction, ray_launch  # noqa: F401
from .program_run import PG_ENV, RayProgramRun


def current_placement_group():
    """Inside a ``ray_launch`` function: the allocation's placement group (Ray tasks started
    there are already placed in it; this is for APIs that take one explicitly)."""
    from ray.util.placement_group import get_current_placement_group
    return get_current_placement_group()


__all__ = ["ray_launch", "RayLaunchFunction", "RayProgramRun", "current_placement_group", "PG_ENV"]

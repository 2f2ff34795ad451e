"""``ray_launch``: run a function once, as a Ray program, on an allocation of the cluster.

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

from ...api import DistributedFunction, decorator
from .program_run import PG_ENV, RayProgramRun


class RayLaunchFunction(DistributedFunction):
    """``@ray_launch``: like ``DistributedFunction``, run once as a Ray program."""

    _backend = "ray_program"
    _kind = "@ray_launch"

    def _launch(self, args, kwargs, *, stream: bool):
        opts = self.options
        if not opts.remote:
            # Not remote: a private Ray instance on this host holds the allocation, sized to
            # this host's GPUs (or 2 CPU slots without one).
            from ...hardware.host import detect
            host = detect()
            gpus = opts.gpus or (len(host.gpus) if host.has_gpu else 2)
            opts = opts.replace(gpus=gpus, cluster="local")
        saved, self.options = self.options, opts
        try:
            return super()._launch(args, kwargs, stream=stream)
        finally:
            self.options = saved


ray_launch = decorator(RayLaunchFunction)
ray_launch.__name__ = "ray_launch"
ray_launch.__doc__ = """Run a function once as a Ray program on ``gpus`` GPUs of a Ray cluster
(see ``gpulaunch.backends.ray.ray_launch``). Same settings as ``@distributed`` (the
``num_accelerators``/``accelerator_type`` spellings included); with ``remote=False`` and no
``cluster``, a private Ray instance on this host holds the allocation."""


def current_placement_group():
    """Inside a ``ray_launch`` function: the allocation's placement group (Ray tasks started
    there are already placed in it; this is for APIs that take one explicitly)."""
    from ray.util.placement_group import get_current_placement_group
    return get_current_placement_group()


__all__ = ["ray_launch", "RayLaunchFunction", "RayProgramRun", "current_placement_group", "PG_ENV"]

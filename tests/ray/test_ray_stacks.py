"""Stacks on demand for a multi-node job: 4 ranks on 2 simulated Ray nodes (the real local Ray
cluster of tests/ray/test_ray.py); each node's agent signals its ranks, the dumps come back through
the run's mirror."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

from test_ray import assert_cluster_free, cluster  # noqa: E402,F401 - the module's fixture

from gpulaunch import RayCluster, distributed  # noqa: E402
from gpulaunch.common.rundir import RunDir  # noqa: E402


def _wait_on_every_node(flag_dir):
    import os
    import time as _t

    from gpulaunch import runtime as rt

    def waiting_on_a_node(rank):
        open(os.path.join(flag_dir, f"ready{rank}"), "w").close()
        while not os.path.exists(os.path.join(flag_dir, "stop")):
            _t.sleep(0.05)

    waiting_on_a_node(rt.get_global_rank())
    return rt.get_node_rank()


def test_stacks_of_a_two_node_ray_job(cluster, tmp_path):  # noqa: F811
    flags = tmp_path / "flags"
    flags.mkdir()
    h = distributed(gpus=4, cluster=RayCluster(), stream_logs="none")(
        _wait_on_every_node).submit(str(flags))
    try:
        deadline = time.monotonic() + 120
        run = RunDir(h.run_dir)
        # every rank waits, and the caller's mirror has heard so (its info file: one poll later)
        while not all((flags / f"ready{r}").exists() and run.rank_info(0, r) for r in range(4)):
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        nodes = RunDir(h.run_dir).launch().cluster["nodes"]
        assert len(nodes) == 2
        stacks = h.stacks()
        assert sorted(stacks) == [0, 1, 2, 3]
        for r in range(4):
            assert "in waiting_on_a_node" in stacks[r], stacks[r]
    finally:
        (flags / "stop").touch()
    assert h.result(timeout=120) == [0, 0, 1, 1]
    assert_cluster_free()

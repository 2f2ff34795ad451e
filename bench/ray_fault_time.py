"""Multi-node on Ray: how long one rank's exception takes to reach the caller.

    python bench/ray_fault_time.py --nodes 3 --slots 2 --reps 5 [--local] [--out fault.json]

Starts a ``ray.cluster_utils.Cluster`` of ``--nodes`` simulated nodes x ``--slots`` CPUs on this
host, then, ``--reps`` times: a gpulaunch Ray run in which every rank does one all_reduce, the
last rank raises (its exception message carries ``time.time()`` at the raise) and the others
wait in a second all_reduce. Measured: from the raise to the moment the caller's
``.distributed()`` raises it, plus the caller's phases after the raise (``RayRun.timings``,
turned into seconds after the raise): ``ended`` (the caller saw the failure), then stopping
the nodes, draining their last files and tearing down. ``--local`` adds the same world size on
one host for comparison. Timings are for reading, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _fail_on_last_rank():
    import time

    import torch
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    if rt.get_global_rank() == rt.get_world_size() - 1:
        raise RuntimeError(f"RAISED_AT={time.time():.6f}")
    dist.all_reduce(t)            # the others wait here until the job is torn down
    return 0


def _raised_at(exc: BaseException) -> float:
    text = str(exc)
    return float(text.split("RAISED_AT=", 1)[1].split()[0])


def one_fault(world: int, cluster) -> dict:
    from gpulaunch import distributed
    fn = distributed(gpus=world, cluster=cluster, stream_logs="none")(_fail_on_last_rank)
    handle = fn.submit()
    run = handle._run                         # the RayRun (or LocalRun) behind the handle
    wall_minus_mono = time.time() - time.monotonic()
    try:
        handle.result()
    except RuntimeError as e:
        caught = time.time()
        raised = _raised_at(e)
    else:
        raise SystemExit("the run did not fail")
    out = {"raise_to_caller_s": round(caught - raised, 3)}
    t0 = getattr(run, "_t0", None)
    if t0 is not None and getattr(run, "timings", None):
        start_wall = t0 + wall_minus_mono
        for phase, at in run.timings.items():
            after = start_wall + at - raised
            if after > -0.5:                   # the phases after the raise
                out[f"{phase}_after_raise_s"] = round(after, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--local", action="store_true", help="also the same world size on one host")
    p.add_argument("--out")
    a = p.parse_args()
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/r-fault-{os.getpid()}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["GPULAUNCH_FORCE_CPU"] = "1"
    os.environ["GPULAUNCH_QUIET"] = "1"
    import ray
    from ray.cluster_utils import Cluster

    from gpulaunch import RayCluster
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": a.slots, "include_dashboard": False})
    for _ in range(a.nodes - 1):
        c.add_node(num_cpus=a.slots)
    ray.init(address=c.address)
    c.wait_for_nodes()
    world = a.nodes * a.slots
    ray_runs, local_runs = [], []
    try:
        one_fault(world, RayCluster())        # warm-up (imports, first actor start)
        for _ in range(a.reps):
            ray_runs.append(one_fault(world, RayCluster()))
            print(json.dumps(ray_runs[-1]), file=sys.stderr, flush=True)
            if a.local:
                local_runs.append(one_fault(world, None)["raise_to_caller_s"])
    finally:
        ray.shutdown()
        c.shutdown()
    totals = [r["raise_to_caller_s"] for r in ray_runs]
    phases = sorted({k for r in ray_runs for k in r if k.endswith("_after_raise_s")})
    out = {"nodes": a.nodes, "slots": a.slots, "reps": a.reps,
           "ray_raise_to_caller_s": totals,
           "ray_median_s": statistics.median(totals),
           "ray_phase_medians_after_raise_s": {
               k: statistics.median(r[k] for r in ray_runs if k in r) for k in phases},
           "local_raise_to_caller_s": local_runs,
           "load_avg": os.getloadavg(), "cpus": os.cpu_count(),
           "python": platform.python_version()}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

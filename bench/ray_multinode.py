"""Multi-node on Ray: where the time of a call goes, next to the same world size on one host.

    python bench/ray_multinode.py --nodes 3 --slots 2 --reps 3 [--out ray.json]   # CPU, simulated
    python bench/ray_multinode.py --gpu [--out ray_gpu.json]                      # GPU machine
    python bench/ray_multinode.py --gpu --smoke                                   # its CPU smoke

CPU mode starts a ``ray.cluster_utils.Cluster`` of ``--nodes`` simulated nodes x ``--slots``
CPUs, then alternates a gpulaunch Ray run (init + one all_reduce, on every slot) with a local
run of the same world size, and reports the phases of the Ray run (connect, placement group,
node agents up, node 0's store up, ranks spawned, results back, teardown).

GPU mode starts a private Ray instance on this machine (cluster="local": every GPU here in one
bundle), and checks what matters on GPUs: Ray hands the bundle's GPUs to the node agent
(CUDA_VISIBLE_DEVICES), every rank gets its own device, NCCL all_reduce gives the right sum.
Writes JSON to --out (and prints it). Timings are for reading, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _allreduce():
    import os

    import torch
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    dev = rt.init()
    t = torch.ones(1, device=dev) * (rt.get_global_rank() + 1)
    dist.all_reduce(t)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"rank": rt.get_global_rank(), "sum": t.item(), "device": str(dev), "name": name,
            "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "node": int(os.environ["NODE_RANK"])}


def _ray_run(gpus: int, cluster):
    from gpulaunch import distributed
    t0 = time.perf_counter()
    handle = distributed(gpus=gpus, cluster=cluster, remote=True,
                         stream_logs="none")(_allreduce).submit()
    results = handle.result()
    run = handle._run          # the RayRun behind the handle: its phase timings
    total = time.perf_counter() - t0
    return results, dict(run.timings, total=round(total, 3))


def cpu_mode(a) -> dict:
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/r-bench-{os.getpid()}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["GPULAUNCH_FORCE_CPU"] = "1"
    os.environ["GPULAUNCH_QUIET"] = "1"
    import ray
    from ray.cluster_utils import Cluster

    from gpulaunch import distributed
    t = time.perf_counter()
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": a.slots, "include_dashboard": False})
    for _ in range(a.nodes - 1):
        c.add_node(num_cpus=a.slots)
    ray.init(address=c.address)
    c.wait_for_nodes()
    cluster_start = time.perf_counter() - t
    world = a.nodes * a.slots
    ray_runs, local_runs = [], []
    try:
        for _ in range(a.reps):
            results, timings = _ray_run(world, c.address)
            assert [r["sum"] for r in results] == [world * (world + 1) / 2] * world, results
            ray_runs.append(timings)
            t = time.perf_counter()
            distributed(gpus=world, stream_logs="none")(_allreduce).distributed()
            local_runs.append(round(time.perf_counter() - t, 3))
    finally:
        ray.shutdown()
        c.shutdown()
    phases = list(ray_runs[0])
    return {"mode": "cpu-simulated", "nodes": a.nodes, "slots": a.slots, "reps": a.reps,
            "cluster_start_s": round(cluster_start, 2),
            "ray_phases_median_s": {p: statistics.median(r[p] for r in ray_runs if p in r)
                                    for p in phases},
            "ray_total_s": [r["total"] for r in ray_runs],
            "local_same_world_total_s": local_runs,
            "load_avg": os.getloadavg(), "cpus": os.cpu_count(), "python": platform.python_version()}


def gpu_mode(a) -> dict:
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/r-bench-{os.getpid()}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["GPULAUNCH_QUIET"] = "1"
    import ray

    from gpulaunch import hardware
    host = hardware.detect()
    n = len(host.gpus)
    if a.smoke and not n:      # no GPU here: the same path (cluster="local") on 2 CPU ranks
        os.environ["GPULAUNCH_FORCE_CPU"] = "1"
        n = 2
    elif not n:
        sys.exit("no GPU here: use the CPU mode, or --gpu --smoke")
    else:
        os.environ.pop("GPULAUNCH_FORCE_CPU", None)
    out = {"mode": "gpu-local-ray" if host.has_gpu else "cpu-smoke-local-ray",
           "host": host.describe(), "runs": []}
    try:
        for _ in range(a.reps):
            results, timings = _ray_run(n, "local")
            ok = ([r["sum"] for r in results] == [n * (n + 1) / 2] * n
                  and (not host.has_gpu or len({r["device"] for r in results}) == n))
            out["runs"].append({"ok": ok, "timings": timings, "results": results})
    finally:
        ray.shutdown()
    out["all_ok"] = all(r["ok"] for r in out["runs"])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--smoke", action="store_true", help="--gpu on a machine without GPU: CPU ranks")
    p.add_argument("--out")
    a = p.parse_args()
    data = gpu_mode(a) if a.gpu else cpu_mode(a)
    text = json.dumps(data, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

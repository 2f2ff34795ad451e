"""The warm rank pool (``keep_alive=``) on real GPUs with NCCL: the second call runs on the same
processes, with the CUDA context, the NCCL communicator and ``rt.state`` (a CUDA model) of the
first, and NCCL all_reduce works on it; ``gpulaunch.shutdown()`` gives the GPU memory back.

The call times are recorded (gpu-records.json), never asserted: the targets are
bench/launch_overhead.py's (``--device cuda --launchers api,api_warm,pool``). What is asserted
is structural: when the warm call's function starts, the CUDA context and the process group of
the first call are already there (no start-up was redone).
"""

from __future__ import annotations

import os
import time

import pytest

import gpulaunch
from gpulaunch import distributed
from gpulaunch import runtime as rt

from .helpers import wait_gpu_released

pytestmark = pytest.mark.gpu


@distributed(keep_alive=120, timeout=300)
def load_model():
    import torch
    import torch.distributed as dist
    dev = rt.init()
    torch.manual_seed(0)
    rt.state["model"] = torch.nn.Linear(1024, 1024, device=dev)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    return {"pid": os.getpid(), "sum": t.item(), "backend": str(dist.get_backend())}


@distributed(keep_alive=120, timeout=300)
def use_model():
    import torch
    import torch.distributed as dist
    t0 = time.time()
    cuda_was_up, group_was_up = torch.cuda.is_initialized(), dist.is_initialized()
    dev = rt.init()                       # the group exists: binds the device, returns at once
    model = rt.state["model"]
    t = torch.full((1,), float(rt.get_global_rank() + 1), device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    out = model(torch.ones(4, 1024, device=dev)).sum().item()
    return {"pid": os.getpid(), "sum": t.item(), "model_out": out,
            "to_collective_in_rank_s": time.time() - t0, "device": str(dev),
            "param_device": str(next(model.parameters()).device),
            "cuda_was_up": cuda_was_up, "group_was_up": group_was_up}


@pytest.mark.timeout(300)
def test_second_call_reuses_ranks_cuda_and_nccl(gpu, record):
    n = gpu.count
    t0 = time.perf_counter()
    first = load_model.distributed()
    cold_s = time.perf_counter() - t0
    assert [r["sum"] for r in first] == [float(n)] * n
    assert {r["backend"] for r in first} == {"nccl"}
    time.sleep(1.0)                       # a person re-running the cell
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        second = use_model.distributed()
        timings.append(time.perf_counter() - t0)
        assert [r["pid"] for r in second] == [r["pid"] for r in first], "new processes"
        assert [r["sum"] for r in second] == [n * (n + 1) / 2] * n, "NCCL all_reduce is wrong"
        assert [r["param_device"] for r in second] == [f"cuda:{i}" for i in range(n)]
        assert len({round(r["model_out"], 3) for r in second}) == 1   # same seeded model
        assert all(r["cuda_was_up"] and r["group_was_up"] for r in second), (
            f"the warm call started without the first call's CUDA context / group: {second}")
    record(pool_cold_first_call_s=round(cold_s, 3),
           pool_warm_calls_s=[round(t, 3) for t in timings],
           pool_warm_in_rank_to_collective_s=[round(r["to_collective_in_rank_s"], 4)
                                               for r in second])
    from gpulaunch.backends.local.pool import POOLS
    run_dir = POOLS.pool.dir.parent.parent / "runs"
    latest = max(run_dir.iterdir(), key=lambda p: p.stat().st_mtime)
    gpulaunch.shutdown()
    record(pool_release=wait_gpu_released(latest, gpu.baseline_mib))

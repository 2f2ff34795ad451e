"""Checks that need a GPU, run on the lent H200: NCCL launch, CUDA OOM report, GPU memory
released after a failure, the launcher memory check (plan=), and the quickstart recipe.

    PYTHONPATH=src python bench/gpu_checks.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from gpulaunch import distributed
from gpulaunch import runtime as rt


def _gpu_info():
    import torch
    import torch.distributed as dist
    dev = rt.init()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    return {"device": str(dev), "name": torch.cuda.get_device_name(dev),
            "backend": dist.get_backend(), "sum": t.sum().item(),
            "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME")}


def _oom():
    import torch
    rt.init()
    keep = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB held
    return torch.empty(1 << 50, dtype=torch.uint8, device="cuda"), keep     # 1 PiB: OOM


def _gpu_processes() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res: dict = {}

    t0 = time.perf_counter()
    res["gpu_info"] = distributed()(_gpu_info).distributed()
    res["gpu_info_seconds"] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    try:
        distributed()(_oom).distributed()
        res["oom"] = "NO ERROR RAISED"
    except BaseException as e:  # noqa: BLE001
        cause = str(e.__cause__ or "")
        res["oom"] = {"type": f"{type(e).__module__}.{type(e).__qualname__}",
                      "rank": getattr(e, "rank", None),
                      "has_memory_summary": "CUDA memory summary" in cause,
                      "seconds_to_error": round(time.perf_counter() - t0, 2),
                      "message_head": str(e)[:300], "cause_head": cause[:1500]}
    time.sleep(1)
    res["gpu_processes_after_failure"] = _gpu_processes()

    # The launcher's memory check on this GPU: refused before any process starts, or launched.
    from gpulaunch.common import rundir
    from gpulaunch.errors import WontFitError
    before = len(list(rundir.runs_root().glob("*"))) if rundir.runs_root().exists() else 0
    t0 = time.perf_counter()
    try:
        distributed(gpus=1, plan={"model": "llama-3.1-70b", "strategy": "ddp"})(_gpu_info).distributed()
        res["plan_refuse"] = "NO ERROR RAISED"
    except WontFitError as e:
        after = len(list(rundir.runs_root().glob("*"))) if rundir.runs_root().exists() else 0
        res["plan_refuse"] = {"message": str(e), "seconds": round(time.perf_counter() - t0, 2),
                              "run_dirs_created": after - before}
    t0 = time.perf_counter()
    out = distributed(gpus=1, plan={"model": "llama-3.2-1b", "strategy": "ddp", "seq_len": 1024})(_gpu_info)
    res["plan_fits"] = {"result": out.distributed(), "seconds": round(time.perf_counter() - t0, 2)}

    t0 = time.perf_counter()
    q = subprocess.run([sys.executable, "recipes/quickstart.py"], capture_output=True, text=True)
    res["quickstart"] = {"rc": q.returncode, "seconds": round(time.perf_counter() - t0, 2),
                         "stdout_tail": q.stdout[-2000:], "stderr_tail": q.stderr[-2000:]}
    with open(os.path.join(a.out, "gpu_checks.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()

"""A fresh caller process, as a notebook kernel is: launches on every GPU and reports, as JSON,

* the launch-time numbers a user feels: three calls of init + one NCCL all_reduce (the first
  cold, the second right after it, the third after the machine sat idle for a few seconds,
  which is what a notebook does between cells), each split into time to the function, to the
  process group, to the end of the first collective, and the whole call;
* each rank's identity (rank, device, GPU uuid, backend, the all_reduce's sum);
* CUDA tensors returned by every rank, nested in a dict, a list, a tuple, a namedtuple and a
  dataclass, plus an ``nn.Parameter`` and a ``state_dict``: where each one arrived;
* whether this process initialised CUDA (``torch.cuda.is_initialized()``) and whether it shows
  up among ``nvidia-smi``'s compute processes.

    python tests/gpu/caller_probe.py OUT.json [GPU_TYPE]

It runs in its own process so that nothing else the test session did decides what it holds.
It never raises: any error is written into the JSON, which the test reads.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

from gpulaunch import distributed
from gpulaunch import runtime as rt

IDLE_S = 7.0   # between the second and third call: the standby agent has imported torch by then


@dataclasses.dataclass
class Box:
    weight: object
    meta: dict


Pair = collections.namedtuple("Pair", "left right")


def first_collective(t_call: float) -> dict:
    """Init + one all_reduce; times are seconds after the caller's call (same host clock)."""
    t_entry = time.time()
    import torch
    import torch.distributed as dist
    dev = rt.init()
    t_init = time.time()
    x = torch.full((1,), float(rt.get_global_rank() + 1), device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize(dev)
    t_coll = time.time()
    props = torch.cuda.get_device_properties(dev)
    return {"rank": rt.get_global_rank(), "local_rank": rt.get_local_rank(),
            "world": rt.get_world_size(), "device": str(dev),
            "current_device": torch.cuda.current_device(), "name": props.name,
            "uuid": str(getattr(props, "uuid", "")), "backend": dist.get_backend(),
            "sum": x.item(), "pid": os.getpid(), "t_entry": t_entry - t_call,
            "t_init": t_init - t_call, "t_collective": t_coll - t_call}


def cuda_results() -> dict:
    """Every kind of container a user returns, holding CUDA tensors of this rank."""
    import torch
    dev = rt.init()
    r = rt.get_global_rank()
    t = torch.arange(4, dtype=torch.float32, device=dev) + r
    lin = torch.nn.Linear(3, 2).to(dev)
    return {"plain": t,
            "list": [t * 2, (t + 1, {"deep": t.to(torch.bfloat16)})],
            "box": Box(weight=t.view(2, 2), meta={"scalar": t[1], "count": 4}),
            "pair": Pair(t[:2], t[2:]),
            "param": lin.weight,
            "state_dict": lin.state_dict(),
            "rank": r, "made_on": str(t.device)}


def _tensors(obj, path="result"):
    """(path, tensor) for every tensor in ``obj``, through dicts, sequences and dataclasses."""
    import torch
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{path}.{f.name}")


def check_results(results: list) -> dict:
    """Where every returned tensor arrived, and whether values and containers survived."""
    import torch
    found, problems = [], []
    for rank, res in enumerate(results):
        for path, t in _tensors(res, f"rank{rank}"):
            found.append({"path": path, "device": str(t.device), "dtype": str(t.dtype),
                          "type": type(t).__name__})
            if t.device.type != "cpu":
                problems.append(f"{path} arrived on {t.device}")
        if any(p["device"] != "cpu" for p in found):
            continue   # reading CUDA values here would initialise CUDA in this process
        base = torch.arange(4, dtype=torch.float32) + rank
        expect = {"plain": (res["plain"], base),
                  "list[0]": (res["list"][0], base * 2),
                  "list[1][0]": (res["list"][1][0], base + 1),
                  "list[1][1].deep": (res["list"][1][1]["deep"], base.to(torch.bfloat16)),
                  "box.weight": (res["box"].weight, base.view(2, 2)),
                  "box.meta.scalar": (res["box"].meta["scalar"], base[1]),
                  "pair": (torch.cat([res["pair"].left, res["pair"].right]), base),
                  "param": (res["param"], res["state_dict"]["weight"])}
        for name, (got, want) in expect.items():
            if not (got.dtype == want.dtype and torch.equal(got.detach(), want)):
                problems.append(f"rank{rank} {name}: got {got!r}, expected {want!r}")
        if not (type(res["box"]).__name__ == "Box" and dataclasses.is_dataclass(res["box"])):
            problems.append(f"rank{rank} box came back as {type(res['box'])}")
        if not (type(res["pair"]).__name__ == "Pair" and hasattr(res["pair"], "_fields")):
            problems.append(f"rank{rank} pair came back as {type(res['pair'])}")
        if res["box"].meta["count"] != 4 or res["rank"] != rank or \
                not res["made_on"].startswith("cuda"):
            problems.append(f"rank{rank}: plain values changed: {res['box'].meta}, "
                            f"{res['rank']}, {res['made_on']}")
    return {"tensors": found, "problems": problems}


def compute_app_pids() -> list[int]:
    p = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                       check=False, capture_output=True, text=True, timeout=30)
    return [int(x) for x in p.stdout.split() if x.strip().isdigit()]


def main(out: str, gpu_type: str | None) -> None:
    t0 = time.perf_counter()
    import torch  # as a notebook does (results hold tensors); importing is not initialising
    report: dict = {"pid": os.getpid(), "import_torch_s": round(time.perf_counter() - t0, 3),
                    "calls": [], "error": None}
    try:
        launch = distributed(gpus=None, gpu_type=gpu_type or None, stream_logs="none",
                             timeout=180)
        probe = launch(first_collective)
        for label in ("first", "second", "third"):
            if label == "third":
                time.sleep(IDLE_S)
            t_call = time.time()
            ranks = probe.distributed(t_call)
            whole = time.time() - t_call
            report["calls"].append({
                "label": label, "idle_before_s": IDLE_S if label == "third" else 0.0,
                "whole_s": round(whole, 3),
                "to_function_s": round(min(r["t_entry"] for r in ranks), 3),
                "to_process_group_s": round(max(r["t_init"] for r in ranks), 3),
                "to_first_collective_s": round(max(r["t_collective"] for r in ranks), 3),
                "ranks": ranks})
        results = launch(cuda_results).distributed()
        report["cuda_results"] = check_results(results)
    except BaseException as e:  # noqa: BLE001 - everything goes into the report
        report["error"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    report["caller"] = {"cuda_initialized": bool(torch.cuda.is_initialized()),
                        "compute_app_pids": compute_app_pids()}
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)

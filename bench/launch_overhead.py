"""Launch overhead: wall time from the call to "results back" for a function that initialises
the process group and runs one all_reduce, for gpulaunch and torchrun, interleaved.

    python bench/launch_overhead.py --ranks 2 --reps 5 [--out results.json]

Each repetition runs every launcher once, in turn, so machine noise hits all of them alike.
Reports median, min and max per launcher. Use on an idle machine; do not assert on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("GPULAUNCH_DEVICE") != "cpu" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    t = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(t)
    dist.destroy_process_group()
""")


def _empty_allreduce():
    import torch
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    dev = rt.init()
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    return t.item()


def time_api(ranks: int) -> float:
    from gpulaunch import distributed
    f = distributed(gpus=ranks, stream_logs="none")(_empty_allreduce)
    t0 = time.perf_counter()
    out = f.distributed()
    assert out == [float(ranks)] * ranks, out
    return time.perf_counter() - t0


def time_cmd(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    os.environ.setdefault("GPULAUNCH_QUIET", "1")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "allreduce.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        launchers = {
            "gpulaunch .distributed()": lambda: time_api(a.ranks),
            "gpulaunch run (CLI)": lambda: time_cmd([sys.executable, "-m", "gpulaunch.cli", "run",
                                                     "--gpus", str(a.ranks), "--logs", "none",
                                                     script]),
            "torchrun": lambda: time_cmd([sys.executable, "-m", "torch.distributed.run",
                                          "--nproc-per-node", str(a.ranks), script]),
        }
        times: dict[str, list[float]] = {k: [] for k in launchers}
        for _ in range(a.reps):
            for name, fn in launchers.items():
                times[name].append(fn())
    import torch
    result = {"ranks": a.ranks, "reps": a.reps, "python": platform.python_version(),
              "torch": torch.__version__, "cpus": os.cpu_count(),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "seconds": times}
    print(f"{'launcher':28s} {'median':>8s} {'min':>8s} {'max':>8s}   ({a.ranks} ranks, {a.reps} reps)")
    for name, ts in times.items():
        print(f"{name:28s} {statistics.median(ts):8.2f} {min(ts):8.2f} {max(ts):8.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

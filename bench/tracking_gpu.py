"""GPU system metrics in a gpulaunch MLflow run, and what tracking costs a launch.

    python bench/tracking_gpu.py                  # on the GPU machine (1 GPU, ~1-2 min)
    python bench/tracking_gpu.py --cpu --seconds 4  # CPU smoke (no GPU keys expected)

1. Runs a 1-GPU job (bf16 matmuls for --seconds) with tracking on, sampling every --interval s;
   rank 0 logs its TFLOP/s with mlflow.log_metric.
2. Reads the run back: every system metric key with its number of points and min/mean/max, and
   checks that the GPU keys (utilisation, memory, power) are there when a GPU is.
3. Times a no-op launch with tracking off and on (whole .distributed() call, second call of
   each, so MLflow's import is warm in the caller as in a notebook).
Writes tracking_gpu.json, system_metrics.png and metrics.png into --out (default $OUT, else ./bench_out/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpulaunch import distributed  # noqa: E402
from gpulaunch import runtime as rt  # noqa: E402


def burn(seconds: float) -> float:
    import mlflow
    import torch
    device = rt.init()
    n = 8192 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    end = time.time() + seconds
    step, best = 0, 0.0
    while time.time() < end:
        t0 = time.perf_counter()
        for _ in range(20):
            c = a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        tflops = 20 * 2 * n ** 3 / (time.perf_counter() - t0) / 1e12
        best = max(best, tflops)
        if rt.is_main():
            mlflow.log_metric("matmul_tflops", tflops, step=step)
        step += 1
    del c
    return best


def noop():
    return rt.get_global_rank()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--cpu", action="store_true", help="smoke mode on a host without GPU")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out",
                   help="folder for the report (default: $OUT, else ./bench_out)")
    a = p.parse_args()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="gpulaunch-tracking-bench-"))
    os.environ["GPULAUNCH_HOME"] = str(home)            # a fresh default sqlite store
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ["GPULAUNCH_SYSTEM_METRICS_INTERVAL"] = str(a.interval)
    os.environ["GPULAUNCH_TRACKING"] = "1"
    if a.cpu:
        os.environ["GPULAUNCH_FORCE_CPU"] = "1"

    t0 = time.perf_counter()
    handle = distributed(gpus=1, stream_logs="rank0")(burn).submit(a.seconds)
    best = handle.result()[0]
    wall = time.perf_counter() - t0
    run_id = handle.mlflow_run_id
    if run_id is None:
        print("no MLflow run was created (see warnings above)")
        return 1

    from mlflow.tracking import MlflowClient

    from gpulaunch.tracking import plot_metrics
    info = json.loads((Path(handle.run_dir) / "tracking.json").read_text())
    client = MlflowClient(info["tracking_uri"])
    run = client.get_run(run_id)
    rows = {}
    for key in sorted(run.data.metrics):
        hist = client.get_metric_history(run_id, key)
        vals = [m.value for m in hist]
        rows[key] = {"points": len(vals), "min": min(vals), "mean": sum(vals) / len(vals),
                     "max": max(vals)}
    width = max(len(k) for k in rows)
    print(f"\nMLflow run {run_id}: status {run.info.status}, job {wall:.1f} s, "
          f"best {best:.1f} TFLOP/s")
    print(f"{'metric'.ljust(width)}  points       min      mean       max")
    for k, r in rows.items():
        print(f"{k.ljust(width)}  {r['points']:6d}  {r['min']:8.1f}  {r['mean']:8.1f}  {r['max']:8.1f}")
    gpu_keys = [k for k in rows if "/gpu_" in k]
    expected = [f"system/node_0/gpu_0_{s}" for s in
                ("utilization_percentage", "memory_usage_megabytes", "power_usage_watts")]
    missing = [k for k in expected if k not in rows]
    if not a.cpu:
        print("GPU system metrics:", "OK" if not missing else f"MISSING {missing}")

    sys_png = plot_metrics(run_id, out / "system_metrics.png", client=client,
                           keys=[k for k in rows if k.startswith("system/")])
    if (Path(handle.run_dir) / "metrics.png").exists():
        shutil.copy(Path(handle.run_dir) / "metrics.png", out / "metrics.png")

    # Launch cost of tracking: a no-op call, off vs on, each timed on its second call.
    timings = {}
    for label, flag in (("off", False), ("on", True)):
        fn = distributed(gpus=1, stream_logs="none", tracking=flag)(noop)
        fn.distributed()
        t = time.perf_counter()
        fn.distributed()
        timings[label] = time.perf_counter() - t
    print(f"no-op launch: tracking off {timings['off']:.2f} s, on {timings['on']:.2f} s")

    result = {"run_id": run_id, "status": run.info.status, "job_wall_s": wall,
              "best_tflops": best, "metrics": rows, "gpu_keys": gpu_keys,
              "missing_gpu_keys": missing if not a.cpu else None,
              "noop_launch_s": timings, "interval_s": a.interval,
              "system_png": str(sys_png) if sys_png else None,
              "artifacts": [f.path for f in client.list_artifacts(run_id)]}
    (out / "tracking_gpu.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'tracking_gpu.json'}")
    shutil.rmtree(home, ignore_errors=True)
    return 0 if (a.cpu or not missing) else 1


if __name__ == "__main__":
    sys.exit(main())

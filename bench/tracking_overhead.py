"""What MLflow tracking adds to a call: tracked and untracked calls of the same function,
interleaved in one process (so load and warm-up hit both alike), medians and their difference.

    python bench/tracking_overhead.py [--calls 5] [--ranks 2] [--warm] [--home DIR] [--out DIR]

Default: cold calls (a fresh agent each). --warm: both on keep_alive pools (the untracked call
then costs a fraction of a second, so the tracking cost is what is left). Target: tracked <=
untracked + 0.1 s (docs/reliability.md).

The calls run in a fresh GPULAUNCH_HOME (a temporary folder, removed at the end) unless
--home names one: every launch prunes old run directories in a background thread of the
caller, and a home with a thousand runs makes that scan, not tracking, the noise of a warm call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from gpulaunch import distributed, shutdown
from gpulaunch.tracking import flush


def step() -> int:
    import torch
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _finished_runs(fn, since: float) -> int:
    """FINISHED MLflow runs of this bench's tracked calls (one per call, the first included)."""
    from mlflow.tracking import MlflowClient

    from gpulaunch.tracking import settings
    client = MlflowClient(settings.default_store_uri())
    exp = client.get_experiment_by_name(settings.DEFAULT_EXPERIMENT)
    runs = client.search_runs([exp.experiment_id], max_results=5000) if exp else []
    return sum(r.info.status == "FINISHED" and r.info.start_time >= since * 1000
               and r.data.tags.get("mlflow.runName") == fn.func.__name__ for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--home", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("GPULAUNCH_QUIET", "1")
    fresh = None if a.home else tempfile.mkdtemp(prefix="gpulaunch-trackbench-")
    os.environ["GPULAUNCH_HOME"] = a.home or fresh
    os.environ["GPULAUNCH_TRACKING"] = "1"     # an inherited 0 would make both untracked
    keep = 120 if a.warm else False
    fns = {"untracked": distributed(gpus=a.ranks, tracking=False, keep_alive=keep,
                                    stream_logs="none")(step),
           "tracked": distributed(gpus=a.ranks, tracking=True, keep_alive=keep,
                                  stream_logs="none")(step)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    started = time.time()
    for name, fn in fns.items():          # first call of each: imports, store, pool start
        fn.distributed()
    for _ in range(a.calls):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            assert fn.distributed() == [a.ranks] * a.ranks
            times[name].append(round(time.perf_counter() - t0, 3))
    shutdown()
    flush(timeout=300)
    runs = _finished_runs(fns["tracked"], started)
    if fresh:
        shutil.rmtree(fresh, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"ranks": a.ranks, "warm": a.warm, "calls": a.calls, "times_s": times,
           "median_s": med, "extra_s": round(med["tracked"] - med["untracked"], 3),
           "ratio": round(med["tracked"] / med["untracked"], 3), "mlflow_runs_finished": runs,
           "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}
    print(json.dumps(row))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "tracking_overhead.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()

"""Issue 17's soak: many launches in a row in ONE process, each with a 10 MB argument, mixed
successes and failures. Records what is left: processes, listening ports, open fds, run
directories, payload files. A benchmark (figures for docs/reliability.md), not a test.

    python bench/disk_soak.py [--launches 200] [--mb 10] [--workers 2] [--out soak.json]

GPULAUNCH_KEEP_RUNS / GPULAUNCH_KEEP_DAYS apply as in any launch (this script sets
GPULAUNCH_KEEP_DAYS=0 and GPULAUNCH_KEEP_RUNS=20 unless given, so that retention shows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import psutil


def _work(blob: bytes, fail: bool):
    import os
    if fail and os.environ["RANK"] == "1":
        raise ValueError("planned failure")
    return len(blob)


def _listening(proc: psutil.Process) -> int:
    n = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            n += sum(1 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)
        except psutil.Error:
            pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("GPULAUNCH_HOME", tempfile.mkdtemp(prefix="gl-soak-"))
    os.environ.setdefault("GPULAUNCH_KEEP_DAYS", "0")
    os.environ.setdefault("GPULAUNCH_KEEP_RUNS", "20")
    os.environ.setdefault("GPULAUNCH_QUIET", "1")
    os.environ.setdefault("GPULAUNCH_TRACKING", "0")
    from gpulaunch import distributed
    from gpulaunch.backends.local.standby import STANDBY
    from gpulaunch.common import rundir
    me = psutil.Process()
    blob = os.urandom(int(a.mb * (1 << 20)))
    fn = distributed(gpus=a.workers, stream_logs="none")(_work)
    fds0, times, ok, failed, wrong = me.num_fds(), [], 0, 0, 0
    for i in range(a.launches):
        fail = i % 4 == 3
        t0 = time.perf_counter()
        try:
            out = fn.distributed(blob, fail)
            ok += 1
            wrong += out != [len(blob)] * a.workers
        except ValueError:
            failed += 1
            wrong += not fail
        times.append(time.perf_counter() - t0)
    time.sleep(1.0)                        # the last launch's prune thread
    STANDBY.close()                        # the one process gpulaunch keeps on purpose
    time.sleep(0.5)
    root = rundir.runs_root()
    dirs = [p for p in root.iterdir() if p.is_dir()]
    kids = [p for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    times.sort()
    report = {
        "launches": a.launches, "arg_mb": a.mb, "workers": a.workers, "succeeded": ok,
        "failed_as_planned": failed, "wrong_outcomes": wrong,
        "median_s": round(times[len(times) // 2], 3), "p95_s": round(times[int(len(times) * .95)], 3),
        "fd_growth": me.num_fds() - fds0, "processes_left": len(kids),
        "listening_ports_left": _listening(me), "run_dirs_left": len(dirs),
        "payloads_left": sum((p / "payload.pkl").exists() for p in dirs),
        "disk_left_mb": round(sum(f.stat().st_size for p in dirs for f in p.rglob("*")
                                  if f.is_file()) / (1 << 20), 2),
        "keep_runs": os.environ["GPULAUNCH_KEEP_RUNS"], "keep_days": os.environ["GPULAUNCH_KEEP_DAYS"],
        "python": sys.version.split()[0], "cpus": os.cpu_count(),
    }
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if not wrong and not kids and not report["payloads_left"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The caller's memory while ranks flood their output: how much the caller's resident memory
grows while it streams a burst of N MB from each rank, and whether the whole burst is still in
the rank logs on disk.

    python bench/log_flood.py [--mb 128] [--ranks 1] [--keep-alive] [--out DIR]

The caller's stdout goes to /dev/null (the terminal's speed is not what is measured); a thread
samples the caller's RSS every 5 ms; "growth" is the peak during the call minus the RSS just
before it. Target: < 50 MB for a 128 MB burst (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

from gpulaunch import distributed, shutdown


def flood(mb: int) -> int:
    import sys as _sys
    line = ("x" * 1023 + "\n")
    block = line * 1024                               # 1 MiB
    for _ in range(mb):
        _sys.stdout.write(block)
    _sys.stdout.flush()
    return mb


def measure(mb: int, ranks: int, keep_alive) -> dict:
    proc = psutil.Process()
    fn = distributed(gpus=ranks, keep_alive=keep_alive, tracking=False)(flood)
    if keep_alive:
        fn.distributed(0)                             # the pool up: measure a warm call
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    devnull = open(os.devnull, "w")
    real = sys.stdout
    before = proc.memory_info().rss
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    sys.stdout = devnull
    try:
        fn.distributed(mb)
    finally:
        sys.stdout = real
        stop.set()
        t.join()
    took = time.perf_counter() - t0
    from gpulaunch.common import rundir
    runs = sorted(rundir.runs_root().iterdir(), key=lambda p: p.stat().st_mtime)
    logs = sorted(runs[-1].glob("attempt*/rank*.log"))
    on_disk = sum(p.stat().st_size for p in logs)
    if keep_alive:
        shutdown()
    return {"mb_per_rank": mb, "ranks": ranks, "warm": bool(keep_alive),
            "rss_before_mb": round(before / 2**20, 1),
            "growth_mb": round((max(peak[0], before) - before) / 2**20, 1),
            "seconds": round(took, 2), "log_bytes_on_disk": on_disk,
            "log_complete": on_disk >= mb * ranks * 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--keep-alive", action="store_true", help="measure a warm (pool) call")
    ap.add_argument("--out", default=None, help="folder for log_flood.json")
    a = ap.parse_args()
    row = measure(a.mb, a.ranks, 60 if a.keep_alive else False)
    print(json.dumps(row))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "log_flood.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()

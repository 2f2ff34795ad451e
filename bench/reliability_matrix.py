"""The failure matrix of docs/reliability.md: for each fault, what the caller gets, how long from
the fault to the caller's error, and how many processes of the run are left (must be 0).

    python bench/reliability_matrix.py [--ranks 2] [--out matrix.json]

"Fault time" is when the faulty rank acts (it writes a timestamp just before); for the external
SIGKILL it is when the signal is sent; for timeouts and hangs it is when the limit expires.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import psutil

from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.common.rundir import RunDir, read_json


def _faulty(mode: str, stamp: str):
    import ctypes
    import time as _t

    import torch
    import torch.distributed as dist
    rt.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    if rt.get_global_rank() == 1:
        with open(stamp, "w") as f:
            f.write(repr(_t.time()))
        if mode == "exception":
            raise ValueError("boom")
        if mode == "sys.exit(3)":
            sys.exit(3)
        if mode == "os._exit(1)":
            os._exit(1)
        if mode == "SIGSEGV":
            ctypes.string_at(0)
        if mode == "MemoryError":
            bytearray(1 << 60)
        if mode in ("SIGKILL (external)", "timeout", "hang"):
            _t.sleep(600)
    dist.all_reduce(t)
    return t.item()


def _alive(pids) -> int:
    n = 0
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                n += 1
        except psutil.NoSuchProcess:
            pass
    return n


def _pids(run: RunDir) -> set[int]:
    st = run.status()
    pids = {int(p) for p in st.pids.values()}
    if st.agent_pid:
        pids.add(int(st.agent_pid))
    return pids


def measure(mode: str, ranks: int) -> dict:
    stamp = tempfile.mktemp()
    kw = {}
    if mode == "timeout":
        kw["timeout"] = 5
    if mode == "hang":
        kw["hang_timeout"] = 5
    f = distributed(gpus=ranks, stream_logs="none", **kw)(_faulty)
    start = time.time()
    h = f.submit(mode, stamp)
    run = RunDir(h.run_dir)
    if mode == "SIGKILL (external)":
        while not os.path.exists(stamp):
            time.sleep(0.02)
        time.sleep(0.2)
        pid = read_json(run.rank_file(0, 1, "info.json"))["pid"]
        fault = time.time()
        os.kill(pid, signal.SIGKILL)
    try:
        h.result(timeout=300)
        got = "no error"
    except BaseException as e:  # noqa: BLE001
        got = f"{type(e).__name__}" + (f" (rank {e.rank})" if getattr(e, "rank", None) is not None else "")
    end = time.time()
    if mode == "timeout":
        fault = start + 5
    elif mode == "hang":
        fault = float(open(stamp).read()) + 5
    elif mode != "SIGKILL (external)":
        fault = float(open(stamp).read())
    time.sleep(0.5)
    return {"fault": mode, "caller_gets": got, "fault_to_error_s": round(end - fault, 2),
            "processes_left": _alive(_pids(run))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args()
    os.environ.setdefault("GPULAUNCH_QUIET", "1")
    rows = [measure(m, a.ranks) for m in ("exception", "sys.exit(3)", "os._exit(1)",
                                           "SIGKILL (external)", "SIGSEGV", "MemoryError",
                                           "timeout", "hang")]
    print("| fault | caller gets | fault → error (s) | processes left |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['caller_gets']} | {r['fault_to_error_s']} | {r['processes_left']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Fault soak: many calls in ONE caller process, warm (a keep_alive pool) and cold, each with a
random outcome on a random rank, and what they leave behind.

    python bench/fault_soak.py [--calls 200] [--seed 0] [--ranks 2] [--out soak.json] > /dev/null

Outcomes (on one rank; its peers wait in an all_reduce it never joins): success; ``raise``;
``sys.exit(3)``; ``os._exit(7)``; SIGKILL of itself; a sleep cut by ``timeout=``; a stuck rank
cut by ``hang_timeout=``; a log flood (``--flood-mb`` MB to stdout, then success); a crash in
attempt 0 under ``max_restarts=1`` (then success). Every (outcome, warm/cold) pair comes once
in a shuffled deck before random draws, so a short soak still covers all of them.

After each call: the caller got the expected result or error type (and exit code, failing
rank); the call ended within its bound (else it is cancelled and counted as a hang); every
process the run recorded is gone, but for the ranks of the live warm pool. At the end, after
``gpulaunch.shutdown()``: no process the soak started survives (the recorded pids, this
process's children, any process whose environment names the soak's GPULAUNCH_HOME), and
nothing under GPULAUNCH_HOME (a fresh one, umask 022) is readable by group or others.
The JSON goes to ``--out`` (and the last line of stdout; the ranks' logs stream to stdout,
so send it to /dev/null). Exit status 0 when clean, 1 otherwise. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import stat
import statistics
import sys
import tempfile
import time

import psutil

KINDS = ("ok", "raise", "exit3", "os_exit", "sigkill", "timeout", "hang", "flood", "restart")
WEIGHTS = (4, 2, 1, 1, 1, 1, 1, 1, 1)
TIMEOUT_S = 5.0          # timeout= of the "timeout" calls
HANG_S = 3.0             # hang_timeout= of the "hang" calls


def faulty(kind: str, bad_rank: int, flood_mb: int) -> int:
    import os
    import signal
    import sys
    import time

    import torch
    import torch.distributed as dist

    from gpulaunch import runtime as rt
    device = rt.init()               # gloo on CPU workers, NCCL on GPUs
    rank = rt.get_global_rank()
    if rank == bad_rank:
        if kind == "raise":
            raise ValueError(f"planned failure on rank {rank}")
        if kind == "exit3":
            sys.exit(3)
        if kind == "os_exit" or (kind == "restart" and rt.get_restart_count() == 0):
            os._exit(7)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind in ("timeout", "hang"):
            time.sleep(3600)
        if kind == "flood":
            line = "x" * 1023 + "\n"
            for _ in range(flood_mb * 1024):
                sys.stdout.write(line)
            sys.stdout.flush()
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    rt.report(step=0, value=float(t.item()))      # rank<r>.metrics.jsonl under the home
    return rank


def plan(calls: int, seed: int) -> list[tuple[str, bool, int]]:
    """(kind, warm, bad rank) per call: every pair once (shuffled), then weighted draws."""
    rng = random.Random(seed)
    deck = [(k, w) for k in KINDS for w in (True, False)]
    rng.shuffle(deck)
    while len(deck) < calls:
        deck.append((rng.choices(KINDS, WEIGHTS)[0], rng.random() < 0.7))
    return [(k, w, rng.randrange(1 << 30)) for k, w in deck[:calls]]


def expect(kind: str, ranks: int, bad: int, result, error) -> str | None:
    """None if the outcome is the one ``kind`` must give, else what was wrong."""
    from gpulaunch.errors import HangError, RunTimeoutError, WorkerCrashError
    got = "result" if error is None else f"{type(error).__name__}: {str(error)[:300]}"
    if kind in ("ok", "flood", "restart"):
        return None if error is None and result == list(range(ranks)) else f"want results, {got}"
    want = {"raise": ValueError, "exit3": WorkerCrashError, "os_exit": WorkerCrashError,
            "sigkill": WorkerCrashError, "timeout": RunTimeoutError, "hang": HangError}[kind]
    if type(error) is not want:
        return f"want {want.__name__}, {got}"
    code = {"exit3": 3, "os_exit": 7, "sigkill": -9}.get(kind)
    if code is not None and getattr(error, "exit_code", None) != code:
        return f"want exit code {code}, got {getattr(error, 'exit_code', None)}: {got}"
    # a hang names the rank its watchdog saw first: the sleeper or a peer stuck waiting for it
    if kind not in ("timeout", "hang") and getattr(error, "rank", None) not in (bad, None):
        return f"want rank {bad}, got rank {getattr(error, 'rank', None)}: {got}"
    return None


def recorded_pids(run_dir: str) -> set[int]:
    from gpulaunch.common.rundir import RunDir
    run = RunDir(run_dir)
    pids = set(run.rank_pids())
    status = run.status()
    if status.agent_pid:
        pids.add(status.agent_pid)
    return pids


def ours(pid: int, home: str) -> bool:
    """``pid`` is alive and one of the soak's (its environment names the soak's home): a
    recorded pid that the system reused for someone else's process does not count."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        env = p.environ()
    except psutil.Error:
        return False
    return env.get("GPULAUNCH_HOME") == home or \
        env.get("GPULAUNCH_RUN_DIR", "").startswith(home + os.sep)


def survivors(pids, home: str, wait: float) -> list[int]:
    deadline = time.monotonic() + wait
    while True:
        left = sorted(p for p in pids if ours(p, home))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def live_pool_pids() -> set[int]:
    from gpulaunch.backends.local.pool_registry import POOLS
    pool = POOLS.pool
    if pool is None or pool.closed is not None:
        return set()
    return set(pool.pids.values())


def readable_by_others(home: str) -> list[str]:
    bad = []
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                bad.append(f"{oct(stat.S_IMODE(mode))} {os.path.relpath(path, home)}")
    return bad


def one_call(fns: dict, kind: str, warm: bool, bad: int, a) -> dict:
    from gpulaunch.common.rundir import RunDir
    fn = fns[(kind, warm)]
    bound = a.bound + (TIMEOUT_S if kind == "timeout" else 0)
    t0 = time.monotonic()
    handle = fn.submit(kind, bad, a.flood_mb)
    ended = handle.wait(bound)
    result = error = None
    if not ended:
        handle.cancel()
    else:
        try:
            result = handle.result()
        except BaseException as e:  # noqa: BLE001 - the outcome under test
            error = e
    rec = {"kind": kind, "warm": warm, "rank": bad, "seconds": round(time.monotonic() - t0, 3),
           "ended_in_bound": ended, "run_dir": handle.run_dir}
    rec["warm_start"] = bool(RunDir(handle.run_dir).status().warm_start)
    rec["wrong"] = None if not ended else expect(kind, a.ranks, bad, result, error)
    rec["pids"] = sorted(recorded_pids(handle.run_dir))
    rec["left"] = survivors(set(rec["pids"]) - live_pool_pids(), a.home, a.exit_wait)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--flood-mb", type=int, default=8)
    ap.add_argument("--bound", type=float, default=120.0,
                    help="seconds a call may take before it counts as a hang")
    ap.add_argument("--exit-wait", type=float, default=15.0,
                    help="seconds a finished run's processes may take to be gone")
    ap.add_argument("--tracking", action="store_true", help="MLflow tracking on every call")
    ap.add_argument("--home", default=None, help="a new GPULAUNCH_HOME (default: a fresh temp dir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.umask(0o022)                       # the usual umask: group and others may read
    if a.home:
        os.makedirs(a.home, mode=0o700)
    a.home = os.path.realpath(a.home or tempfile.mkdtemp(prefix="gpulaunch-soak-"))
    os.environ["GPULAUNCH_HOME"] = a.home
    os.environ["GPULAUNCH_TRACKING"] = "1" if a.tracking else "0"
    os.environ.setdefault("GPULAUNCH_QUIET", "1")

    import gpulaunch
    import gpulaunch.tracking
    from gpulaunch import distributed
    base = {(k, w): distributed(gpus=a.ranks, keep_alive=120 if w else False)(faulty)
            for k in KINDS for w in (True, False)}
    fns = {key: fn.with_overrides(**({"timeout": TIMEOUT_S} if key[0] == "timeout" else
                                     {"hang_timeout": HANG_S} if key[0] == "hang" else
                                     {"max_restarts": 1} if key[0] == "restart" else {}))
           for key, fn in base.items()}
    started = time.time()
    records = []
    for n, (kind, warm, seed) in enumerate(plan(a.calls, a.seed)):
        rec = one_call(fns, kind, warm, seed % a.ranks, a)
        rec["call"] = n
        records.append(rec)
        flag = "" if rec["ended_in_bound"] and not rec["wrong"] and not rec["left"] else "  <--"
        print(f"soak: call {n} {kind} {'warm' if warm else 'cold'} rank {rec['rank']}: "
              f"{rec['seconds']} s{flag}", file=sys.stderr, flush=True)

    if a.tracking:
        gpulaunch.tracking.flush(timeout=300)
    gpulaunch.shutdown()
    every_pid = set().union(*(set(r["pids"]) for r in records)) if records else set()
    left_end = survivors(every_pid, a.home, a.exit_wait)
    children = [f"{c.pid} {' '.join(c.cmdline())[:200]}"
                for c in psutil.Process().children(recursive=True) if c.is_running()]
    strays = [p.pid for p in psutil.process_iter() if p.pid != os.getpid() and ours(p.pid, a.home)]
    secs = sorted(r["seconds"] for r in records)
    summary = {
        "calls": len(records), "seed": a.seed, "ranks": a.ranks, "tracking": a.tracking,
        "by_kind": {k: sum(r["kind"] == k for r in records) for k in KINDS},
        "warm_calls": sum(r["warm"] for r in records),
        "warm_calls_served_by_a_live_pool": sum(r["warm"] and r["warm_start"] for r in records),
        "wrong": [r for r in records if r["wrong"]],
        "hangs": [r for r in records if not r["ended_in_bound"]],
        "left_after_call": [r for r in records if r["left"]],
        "left_at_end": left_end, "children_at_end": children, "strays_at_end": strays,
        "readable_by_others": readable_by_others(a.home),
        "seconds": {"median": statistics.median(secs) if secs else None,
                    "p95": secs[int(0.95 * (len(secs) - 1))] if secs else None,
                    "max": secs[-1] if secs else None},
        "wall_s": round(time.time() - started, 1), "load_average": os.getloadavg(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "home": a.home,
    }
    clean = not any(summary[k] for k in ("wrong", "hangs", "left_after_call", "left_at_end",
                                         "children_at_end", "strays_at_end",
                                         "readable_by_others"))
    summary["clean"] = clean
    text = json.dumps(summary, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps(summary))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

"""Launch soak: many launches in a row, each in a fresh caller process, and count the ones that
never reach their first collective.

This is how the fork deadlock of docs/architecture.md ("No forked rank runs before the last
fork") was found and how its fix was checked: it struck 1 launch in tens, so only a long run
shows it. Each caller process makes ``--calls`` launches of the empty function (the first
cold, the next ones through the standby agent); a launch that has not finished after
``--stuck-after`` seconds is recorded as stuck with every process's stack (``py-spy dump
--native`` when py-spy is on PATH or given with ``--py-spy``; it is not a dependency) and
then cancelled.

    python bench/launch_soak.py --launches 200 --workers 4 --out /tmp/soak

Results: ``<out>/launch_soak.json`` (per launch: ok / stuck / error, seconds) and
``<out>/launch_soak.md``. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _proc import exit_on_sigterm, run_group  # bench/_proc.py

ROOT = Path(__file__).resolve().parents[1]


def empty_fn() -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    out = t.item()
    dist.destroy_process_group()
    return out


def one_caller(workers: int, calls: int, stuck_after: float, py_spy: str | None) -> list[dict]:
    """Runs in its own process: ``calls`` launches, one after the other."""
    from gpulaunch import distributed
    from gpulaunch.backends.local.standby import STANDBY
    from gpulaunch.common.rundir import RunDir

    fn = distributed(gpus=workers, stream_logs="none", tracking=False)(empty_fn)
    out = []
    for call in range(calls):
        if call:
            STANDBY.wait_ready(60)
        t0 = time.monotonic()
        handle = fn.submit()
        if handle.wait(stuck_after):
            try:
                ok = handle.result() == [float(workers)] * workers
                r = {"state": "ok" if ok else "wrong result"}
            except Exception as e:  # noqa: BLE001 - recorded
                r = {"state": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
        else:
            status = RunDir(handle.run_dir).status().to_data()
            r = {"state": "stuck", "run_dir": handle.run_dir, "status": status,
                 "stacks": _stacks(status, py_spy)}
            handle.cancel()
        r.update(call=call, seconds=round(time.monotonic() - t0, 3),
                 warm=bool(RunDir(handle.run_dir).status().warm_start))
        out.append(r)
    return out


def _stacks(status: dict, py_spy: str | None) -> dict:
    if not py_spy:
        return {}
    pids = [status.get("agent_pid")] + list((status.get("pids") or {}).values())
    stacks = {}
    for pid in filter(None, pids):
        proc = subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)],
                              capture_output=True, text=True)
        # pybind11's template names fill whole screens: keep every frame, cut each line short
        text = "\n".join(line[:160] for line in (proc.stdout + proc.stderr).splitlines())
        stacks[str(pid)] = text[:8000]
    return stacks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=200, help="caller processes")
    p.add_argument("--calls", type=int, default=2, help="launches per caller process")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--stuck-after", type=float, default=30.0)
    p.add_argument("--py-spy", default=shutil.which("py-spy"))
    p.add_argument("--out", required=True)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one_caller(a.workers, a.calls, a.stuck_after, a.py_spy)),
              flush=True)
        return

    exit_on_sigterm()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="soak-"))
    env = {**os.environ, "GPULAUNCH_QUIET": "1", "GPULAUNCH_HOME": str(home / "home"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--one", "--workers", str(a.workers), "--calls",
           str(a.calls), "--stuck-after", str(a.stuck_after), "--out", str(out)]
    if a.py_spy:
        cmd += ["--py-spy", a.py_spy]
    results, start = [], time.time()
    for i in range(a.launches):
        try:
            proc = run_group(cmd, env=env, timeout=a.calls * (a.stuck_after + 60) + 120)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            rs = json.loads(lines[-1][len("RESULT "):]) if lines else [
                {"state": "error", "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}]
        except subprocess.TimeoutExpired:
            rs = [{"state": "error", "error": "the caller process timed out"}]
        for r in rs:
            r["caller"] = i
        results.extend(rs)
        print(f"caller {i}: {[r['state'] for r in rs]}", flush=True)
    shutil.rmtree(home, ignore_errors=True)
    counts: dict = {}
    for r in results:
        key = ("warm" if r.get("warm") else "cold", r["state"])
        counts[key] = counts.get(key, 0) + 1
    import torch
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
            "workers": a.workers, "launches": a.launches, "calls": a.calls,
            "stuck_after": a.stuck_after, "wall_s": round(time.time() - start, 1)}
    lines = [f"Launch soak: {a.launches} caller processes x {a.calls} launches of {a.workers} "
             f"CPU ranks (gloo), a launch counted stuck after {a.stuck_after:g} s. "
             f"{meta['host']}: {meta['cpus']} cores, Python {meta['python']}, torch "
             f"{meta['torch']}; {meta['date']}; {meta['wall_s']:.0f} s.", "",
             "| start | outcome | launches |", "|---|---|---|"]
    lines += [f"| {k[0]} | {k[1]} | {v} |" for k, v in sorted(counts.items())]
    for r in results:
        if r["state"] != "ok":
            lines += ["", f"caller {r['caller']} call {r['call']}: {r['state']} "
                      f"{r.get('run_dir', '')} {r.get('error', '')}"[:3000]]
    text = "\n".join(lines) + "\n"
    (out / "launch_soak.md").write_text(text)
    (out / "launch_soak.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()

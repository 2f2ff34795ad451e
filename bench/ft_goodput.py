"""Per-step fault tolerance (gpulaunch.ft, torchft) against restart-from-checkpoint, on CPU.

    python bench/ft_goodput.py --replicas 2 --duration 150 --fail-every 30:60 --out ft.json
    python bench/ft_goodput.py --quick          # one failure in a short run of each mode (CI)

The same training (an MLP, Adam, one batch per replica per step, data chosen by step and
replica) runs for ``--duration`` seconds of wall time in each mode, while a killer SIGKILLs
one training process every ``--fail-every`` seconds (uniform in MIN:MAX, seeded):

* ``ft``: ``--replicas`` replica groups of one rank under ``gpulaunch.ft.run_replicas`` (a warm
  spare, the lighthouse on loopback); the killed group is replaced and heals from a live peer.
* ``ckpt``: one gpulaunch launch of ``--replicas`` ranks (torch DDP over gloo) with
  ``max_restarts``; rank 0 saves a checkpoint every ``--ckpt-every`` steps; a kill restarts the
  whole group, which resumes from the last checkpoint.

Measured: batches committed (a run step with n live replicas commits n batches), goodput
(batches per second over the run, as a fraction of the failure-free rate measured by
``--baseline`` seconds of each mode without kills), and per kill the time from the SIGKILL to
the killed process's group's next committed step, and how long the run as a whole committed no
new step around each kill beyond its usual step time (``run_stall_s``; for ckpt the steps
rolled back are not new). Timings are for reading, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


# ---------------------------------------------------------------------------- rank side
def _model(width: int):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 1))


def _batch(step: int, replica: int, rows: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(rows, 64, generator=g)
    return x, x[:, :8].sum(1, keepdim=True).tanh()


def ft_train(stop_file: str, width: int, rows: int):
    import os

    import torch

    from gpulaunch import ft
    model = _model(width)
    r = ft.replicated(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    while not os.path.exists(stop_file):
        r.optimizer.zero_grad()
        x, y = _batch(r.step, ft.replica_id(), rows)
        torch.nn.functional.mse_loss(r.model(x), y).backward()
        r.optimizer.step()
    out = r.summary()
    r.shutdown()
    return out


def ckpt_train(stop_file: str, width: int, rows: int, ckpt_every: int, folder: str):
    import json
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpulaunch import runtime as rt
    rt.init()
    rank, attempt = rt.get_global_rank(), rt.get_restart_count()
    with open(os.path.join(folder, f"ckpt.attempt{attempt}.rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model = _model(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    path = os.path.join(folder, "latest.pt")
    step = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    ddp = DDP(model)
    go = torch.ones(1)
    while True:
        go.fill_(0.0 if os.path.exists(stop_file) else 1.0)
        dist.all_reduce(go, op=dist.ReduceOp.MIN)        # every rank stops at the same step
        if go.item() == 0:
            break
        opt.zero_grad()
        x, y = _batch(step, rank, rows)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        step += 1
        if rank == 0:
            with open(os.path.join(folder, "ckpt.steps.jsonl"), "a") as f:
                f.write(json.dumps({"a": attempt, "step": step, "t": time.time(),
                                    "n": dist.get_world_size()}) + "\n")
            if step % ckpt_every == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
    return step


# ---------------------------------------------------------------------------- caller side
def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


class Killer:
    """SIGKILLs one live training process at seeded random intervals, from the first step."""

    def __init__(self, fail_every: tuple[float, float] | None, seed: int):
        self.rng = random.Random(seed)
        self.fail_every = fail_every
        self.kills: list[dict] = []
        self.next_t = float("inf")

    def _gap(self) -> float:
        return self.rng.uniform(*self.fail_every) if self.fail_every else float("inf")

    def started(self, t: float, end: float) -> None:
        self.next_t, self.end = t + self._gap(), end

    def due(self) -> bool:
        now = time.time()
        return now >= self.next_t and now < self.end - 3

    def kill(self, target: str, pids: list[int], **info) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.kills.append({"t": time.time(), "target": target, "pids": pids, **info})
        self.next_t = time.time() + self._gap()


class Window:
    """The measured interval: ``duration`` seconds from the run's first committed step (the
    launch and imports, seconds on a busy host, are the same in both modes and left out)."""

    def __init__(self, duration: float, stop_file: Path, killer: Killer):
        self.duration, self.stop_file, self.killer = duration, stop_file, killer
        self.start = self.end = None

    def tick(self, first_t: float | None) -> bool:
        """True while training should go on."""
        if self.start is None and first_t is not None:
            self.start, self.end = first_t, first_t + self.duration
            self.killer.started(self.start, self.end)
        if self.end is not None and time.time() >= self.end:
            self.stop_file.touch()
            return False
        return True


def _progress(records: list[dict], end: float) -> tuple[int, int]:
    """(run step, batches committed) at time ``end``: the step counter then (after any
    rollback) and the batches of the steps up to it (n live replicas commit n batches)."""
    last = None
    for r in records:
        if r["t"] <= end:
            last = r
    if last is None:
        return 0, 0
    # the participants of each step as recorded by the attempt that reached ``last``
    n_by_step = {}
    for r in records:
        if r["t"] <= end:
            n_by_step[r["step"]] = r["n"]
    return last["step"], sum(n for s, n in n_by_step.items() if s <= last["step"])


def _per_10s(records: list[dict], start: float, end: float) -> list[int]:
    """Run steps first committed in each 10 s of the window (stalls show as small counts)."""
    seen, buckets = set(), [0] * max(1, int((end - start + 9.999) // 10))
    for r in records:
        if start <= r["t"] < end and r["step"] not in seen:
            seen.add(r["step"])
            buckets[int((r["t"] - start) // 10)] += 1
    return buckets


def _stalls(records: list[dict], kill_times: list[float], start: float, end: float) -> list:
    """Per kill: how long the run went without committing a new step around it, beyond its
    usual step time (the longest gap between new run steps from the kill to 10 s after it,
    less the median gap of the window); None when nothing was committed after it."""
    first: dict[int, float] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        first.setdefault(r["step"], r["t"])
    ts = sorted(t for t in first.values() if start <= t <= end)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    if not gaps:
        return [None] * len(kill_times)
    usual = statistics.median(gaps)
    out = []
    for k in kill_times:
        around = [b - a for a, b in zip(ts, ts[1:]) if b >= k and a <= k + 10]
        out.append(round(max(around) - usual, 3) if around else None)
    return out


def run_ft(a, duration: float, fail_every, folder: Path) -> dict:
    from gpulaunch import ft
    from gpulaunch.ft.result import read_steps
    killer = Killer(fail_every, a.seed)
    window = Window(duration, folder / "stop", killer)

    def on_poll(groups):
        firsts = [s[0]["t"] for s in (read_steps(groups.ft_dir, i)[:1]
                                      for i in range(a.replicas)) if s]
        if not window.tick(min(firsts, default=None)) or not killer.due():
            return
        # a group that has committed in its current attempt (not one still healing)
        ready = [i for i in groups.handles
                 if any(r["a"] == groups.attempts[i] for r in read_steps(groups.ft_dir, i)[-3:])]
        if ready:
            i = killer.rng.choice(sorted(ready))
            killer.kill(f"replica {i}", ft.group_pids(groups.ft_dir, i, groups.attempts[i]),
                        replica=i, attempt=groups.attempts[i])

    res = ft.run_replicas(ft_train, str(folder / "stop"), a.width, a.rows, replicas=a.replicas,
                          max_group_restarts=100, ft_dir=str(folder), on_poll=on_poll,
                          timeout=duration + 600)
    merged = sorted((r for recs in res.steps.values() for r in recs), key=lambda r: r["t"])
    step, batches = _progress(merged, window.end)
    recoveries = []
    for k in killer.kills:
        nxt = [r for r in res.steps[k["replica"]] if r["a"] == k["attempt"] + 1]
        recoveries.append(round(nxt[0]["t"] - k["t"], 3) if nxt else None)
    return {"batches": batches, "run_steps": step, "wall_s": duration,
            "kills": len(killer.kills), "recovery_s": recoveries,
            "kill_at_s": [round(k["t"] - window.start, 1) for k in killer.kills],
            "steps_per_10s": _per_10s(merged, window.start, window.end),
            "run_stall_s": _stalls(merged, [k["t"] for k in killer.kills], window.start,
                                   window.end),
            "failures": [{"replica": f.replica, "attempt": f.attempt, "healed_to": f.healed_to,
                          "steps_missed": f.steps_missed} for f in res.failures]}


def run_ckpt(a, duration: float, fail_every, folder: Path) -> dict:
    from gpulaunch import distributed
    killer = Killer(fail_every, a.seed)
    window = Window(duration, folder / "stop", killer)
    f = distributed(gpus=a.replicas, max_restarts=100, stream_logs="none", tracking=False,
                    panel=False, timeout=duration + 600)(ckpt_train)
    handle = f.submit(str(folder / "stop"), a.width, a.rows, a.ckpt_every, str(folder))
    steps_file = folder / "ckpt.steps.jsonl"
    while not handle.done():
        recs = _read_jsonl(steps_file)
        if window.tick(recs[0]["t"] if recs else None) and killer.due():
            attempt = recs[-1]["a"]
            rank = killer.rng.randrange(a.replicas)
            pid_file = folder / f"ckpt.attempt{attempt}.rank{rank}.pid"
            if pid_file.exists():
                killer.kill(f"rank {rank}", [int(pid_file.read_text())], rank=rank,
                            attempt=attempt, step=recs[-1]["step"])
        time.sleep(0.1)
    handle.result()
    recs = _read_jsonl(steps_file)
    step, batches = _progress(recs, window.end)
    recoveries, back = [], []
    for k in killer.kills:
        nxt = [r for r in recs if r["a"] > k["attempt"]]
        recoveries.append(round(nxt[0]["t"] - k["t"], 3) if nxt else None)
        again = [r for r in nxt if r["step"] > k["step"]]
        back.append(round(again[0]["t"] - k["t"], 3) if again else None)
    return {"batches": batches, "run_steps": step, "wall_s": duration,
            "kills": len(killer.kills), "recovery_s": recoveries,
            "back_to_pre_kill_step_s": back,
            "kill_at_s": [round(k["t"] - window.start, 1) for k in killer.kills],
            "steps_per_10s": _per_10s(recs, window.start, window.end),
            "run_stall_s": _stalls(recs, [k["t"] for k in killer.kills], window.start,
                                   window.end)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of training per mode")
    p.add_argument("--fail-every", default="30:60", help="MIN:MAX seconds between kills")
    p.add_argument("--baseline", type=float, default=40.0,
                   help="seconds of failure-free training per mode (0: skip)")
    p.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--modes", default="ft,ckpt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 10 s per mode, one kill at 4 s, no baseline")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.fail_every, a.baseline, a.width, a.rows = 10.0, "4:4", 0.0, 64, 32
    lo, hi = (float(v) for v in a.fail_every.split(":"))
    out = {"command": "python bench/ft_goodput.py " + " ".join(argv or sys.argv[1:]),
           "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.platform()}",
           "load_avg_before": os.getloadavg(), "settings": vars(a), "modes": {}}
    runners = {"ft": run_ft, "ckpt": run_ckpt}
    for mode in a.modes.split(","):
        res = {}
        if a.baseline > 0:
            with tempfile.TemporaryDirectory(prefix=f"ftbench-{mode}-") as d:
                res["failure_free"] = runners[mode](a, a.baseline, None, Path(d))
        with tempfile.TemporaryDirectory(prefix=f"ftbench-{mode}-") as d:
            res["with_failures"] = runners[mode](a, a.duration, (lo, hi), Path(d))
        for key in ("failure_free", "with_failures"):
            if key in res:
                r = res[key]
                r["batches_per_s"] = round(r["batches"] / r["wall_s"], 3)
        if "failure_free" in res:
            res["goodput"] = round(res["with_failures"]["batches_per_s"]
                                   / res["failure_free"]["batches_per_s"], 3)
        rec = [s for s in res["with_failures"]["recovery_s"] if s is not None]
        res["recovery_median_s"] = statistics.median(rec) if rec else None
        out["modes"][mode] = res
        print(mode, json.dumps(res), flush=True)
    if "ft" in out["modes"] and "ckpt" in out["modes"]:
        ft_r, ck_r = out["modes"]["ft"]["with_failures"], out["modes"]["ckpt"]["with_failures"]
        out["ft_over_ckpt_batches"] = round(ft_r["batches_per_s"] / ck_r["batches_per_s"], 3) \
            if ck_r["batches_per_s"] else None
        print("ft / ckpt batches per second with failures:", out["ft_over_ckpt_batches"])
    out["load_avg_after"] = os.getloadavg()
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

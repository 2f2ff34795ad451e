"""Steady-state overhead: the same DDP training loop under gpulaunch and under torchrun.

One function, ``train_loop``, trains an MLP with DDP (gloo on CPU by default) and times each
step on every rank. It runs, interleaved (A B A B ...):

* ``gpulaunch``: ``distributed(gpus=N)(train_loop).distributed(...)``;
* ``torchrun``: ``torchrun --nproc-per-node N bench/steady_state.py --worker ...``, a plain
  script that calls ``init_process_group`` itself and then the very same ``train_loop``.

The number that matters is the throughput ratio gpulaunch / torchrun = median step time under
torchrun / median step time under gpulaunch (target >= 0.99). Each rank reports its threads
(``torch.get_num_threads()``) so a difference of environment would show.

    python bench/steady_state.py --reps 4 --steps 60 --out /tmp/ss
    python bench/steady_state.py --reps 1 --steps 3 --warmup 1 --dim 64     # smoke

Results: ``<out>/steady_state.{json,md}``. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _proc import exit_on_sigterm, run_group  # bench/_proc.py

ROOT = Path(__file__).resolve().parents[1]


def train_loop(steps: int, warmup: int, dim: int, layers: int, batch: int, seed: int = 0) -> dict:
    """The training loop both launchers run (the process group already exists)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(dim, dim), nn.GELU()]
    model = DDP(nn.Sequential(*blocks, nn.Linear(dim, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch, dim, generator=g)
    y = torch.randn(batch, 1, generator=g)
    times = []
    for step in range(warmup + steps):
        t = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()   # gradient all_reduce (gloo) happens in here
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t)
    dist.barrier()
    return {"rank": rank, "world": world, "threads": torch.get_num_threads(),
            "median_step_s": statistics.median(times), "mean_step_s": sum(times) / len(times),
            "loss": float(loss), "params": sum(p.numel() for p in model.parameters())}


def gpulaunch_job(**loop_args) -> dict:
    """Under gpulaunch: the same init_process_group call as the torchrun script, then the loop."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    try:
        return train_loop(**loop_args)
    finally:
        dist.destroy_process_group()


def _loop_args(a) -> dict:
    return dict(steps=a.steps, warmup=a.warmup, dim=a.dim, layers=a.layers, batch=a.batch)


def run_gpulaunch(a) -> list[dict]:
    from gpulaunch import distributed
    return distributed(gpus=a.nproc, stream_logs="none", timeout=a.timeout)(gpulaunch_job).distributed(
        **_loop_args(a))


def run_torchrun(a, work: Path) -> list[dict]:
    out = work / f"torchrun-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
           "--standalone", __file__, "--worker",
           str(out), "--steps", str(a.steps), "--warmup", str(a.warmup), "--dim", str(a.dim),
           "--layers", str(a.layers), "--batch", str(a.batch)]
    proc = run_group(cmd, timeout=a.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def torchrun_worker(a) -> None:
    """What the hand-written torchrun script does: init, train, report, destroy."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    res = train_loop(**_loop_args(a))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res)
    if dist.get_rank() == 0:
        Path(a.worker).write_text("\n".join(json.dumps(r) for r in gathered))
    # The DDP model is gone but its reducer's reference cycle still holds the process group:
    # collect it now, or torch 2.14's gloo group is torn down at interpreter exit, which aborts
    # the rank ("terminate called without an active exception", SIGABRT) in a good share of
    # runs. gpulaunch's ranks end with os._exit and never meet this.
    import gc
    gc.collect()
    dist.destroy_process_group()
    # ...and leave without the interpreter's teardown: even so, torch 2.14's gloo still aborted
    # a rank there once in five CI runs (SIGABRT after the results were written). The
    # measurement is over and on disk; what is left to run is only that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=4, help="runs per launcher, interleaved")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        torchrun_worker(a)
        return

    exit_on_sigterm()
    os.environ.setdefault("GPULAUNCH_QUIET", "1")
    os.environ["GPULAUNCH_FORCE_CPU"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = Path(tempfile.mkdtemp(prefix="steady-"))
    os.environ.setdefault("GPULAUNCH_HOME", str(work / "home"))
    os.environ["TMPDIR"] = str(work)
    sys.path.insert(0, str(ROOT / "src"))
    out = Path(a.out or work)
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[str, list] = {"gpulaunch": [], "torchrun": []}
    loads = []
    for rep in range(a.reps):
        order = ["gpulaunch", "torchrun"] if rep % 2 == 0 else ["torchrun", "gpulaunch"]
        for name in order:
            loads.append(os.getloadavg()[0])
            t = time.perf_counter()
            ranks = run_gpulaunch(a) if name == "gpulaunch" else run_torchrun(a, work)
            wall = time.perf_counter() - t
            step = statistics.median(r["median_step_s"] for r in ranks)
            runs[name].append({"median_step_s": step, "wall_s": wall, "load1": loads[-1],
                               "threads": sorted({r["threads"] for r in ranks}), "ranks": ranks})
            print(f"rep {rep} {name}: median step {step * 1e3:.1f} ms (threads "
                  f"{runs[name][-1]['threads']}, load {loads[-1]:.2f})", flush=True)

    med = {k: statistics.median(r["median_step_s"] for r in v) for k, v in runs.items()}
    ratio = med["torchrun"] / med["gpulaunch"]
    import torch
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "args": vars(a), "params": runs["gpulaunch"][0]["ranks"][0]["params"],
            "load_median": statistics.median(loads), "load_min": min(loads), "load_max": max(loads),
            "throughput_ratio_gpulaunch_over_torchrun": ratio,
            "command": " ".join(["python"] + sys.argv)}
    lines = [f"DDP MLP ({meta['params'] / 1e6:.1f} M params, dim {a.dim} x {a.layers} layers, batch "
             f"{a.batch}), gloo on CPU, {a.nproc} ranks, {a.steps} timed steps after {a.warmup} "
             f"warm-up per run, {a.reps} interleaved runs per launcher. {meta['host']}: "
             f"{meta['cpus']} cores, torch {meta['torch']}, {meta['date']}; load average median "
             f"{meta['load_median']:.2f} ({meta['load_min']:.2f}–{meta['load_max']:.2f}).", "",
             "| launcher | median step (ms), median of runs | runs (ms) | threads per rank |",
             "|---|---|---|---|"]
    for k, v in runs.items():
        each = ", ".join(f"{r['median_step_s'] * 1e3:.1f}" for r in v)
        lines.append(f"| {k} | {med[k] * 1e3:.1f} | {each} | {v[0]['threads']} |")
    lines += ["", f"Throughput ratio gpulaunch / torchrun: **{ratio:.3f}** (target >= 0.99)."]
    text = "\n".join(lines) + "\n"
    (out / "steady_state.md").write_text(text)
    (out / "steady_state.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    print(text)


if __name__ == "__main__":
    main()

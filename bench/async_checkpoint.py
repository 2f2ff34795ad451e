"""Training stall of a checkpoint: ``save_checkpoint`` synchronous vs ``async_save=True``.

One process trains a stack of Linear layers (AdamW, so the checkpoint is weights + 2 moments)
and saves every ``--every`` steps, alternately sync and async. Per save it records:

* ``stall_s``: how long ``save_checkpoint`` held the training loop (the number that matters);
* ``overlap_step_s``: the median step time while an async write runs in the background (it
  competes with training for host CPU, memory bandwidth and, on CPU, the cores themselves);
* ``write_s``: for async, from the call until the checkpoint is published.

    python bench/async_checkpoint.py --out /tmp/ack                        # CPU, ~100M params
    python bench/async_checkpoint.py --device cuda --params-m 1000 --out $OUT   # GPU, 1B params
    python bench/async_checkpoint.py --smoke --out /tmp/ack                # seconds

Results: ``<out>/async_checkpoint.{json,md}``. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _model(params_m: float, dim: int):
    import torch
    layers = max(1, round(params_m * 1e6 / (dim * dim + dim)))
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)]), layers


def run(args) -> dict:
    import torch

    from gpulaunch.parallel import prepare, save_checkpoint, wait_for_checkpoint
    from gpulaunch.parallel._async_save import in_flight
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, layers = _model(args.params_m, args.dim)
    p = prepare(model.to(device), lambda ps: torch.optim.AdamW(ps, lr=1e-4), strategy="none",
                device=device)
    n_params = sum(t.numel() for t in model.parameters())
    x = torch.randn(args.batch, args.dim, device=device)
    root = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="ack-"))

    def step():
        t = time.perf_counter()
        p.backward(p.model(x).float().pow(2).mean())
        p.step()
        p.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(args.warmup):
        step()
    base = [step() for _ in range(args.every)]
    saves = []
    for i in range(args.saves):
        mode = "async" if i % 2 else "sync"
        t0 = time.perf_counter()
        save_checkpoint(str(root), p, step=i + 1, keep=1, async_save=(mode == "async"))
        if device.type == "cuda":
            torch.cuda.synchronize()
        stall = time.perf_counter() - t0
        steps, written = [], None
        for _ in range(args.every):
            steps.append(step())
            if written is None and mode == "async" and not in_flight():
                written = time.perf_counter() - t0
        if mode == "async" and written is None:
            wait_for_checkpoint()
            written = time.perf_counter() - t0
        saves.append({"mode": mode, "stall_s": round(stall, 4),
                      "overlap_step_s": round(statistics.median(steps), 5),
                      "write_s": round(written, 3) if written is not None else None})
    wait_for_checkpoint()
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    if not args.ckpt_dir:
        shutil.rmtree(root, ignore_errors=True)

    def med(mode, key):
        vals = [s[key] for s in saves if s["mode"] == mode and s[key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {"device": str(device), "gpu": torch.cuda.get_device_name(0) if device.type == "cuda"
            else None, "torch": torch.__version__, "host": platform.node(),
            "cpus": os.cpu_count(), "params": n_params, "layers": layers, "dim": args.dim,
            "checkpoint_bytes": size, "base_step_s": round(statistics.median(base), 5),
            "sync_stall_s": med("sync", "stall_s"), "async_stall_s": med("async", "stall_s"),
            "async_overlap_step_s": med("async", "overlap_step_s"),
            "async_write_s": med("async", "write_s"), "saves": saves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--params-m", type=float, default=100.0, help="model size, millions")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--every", type=int, default=10, help="steps between saves")
    ap.add_argument("--saves", type=int, default=6, help="alternately sync and async")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ckpt-dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="/tmp/async_checkpoint")
    args = ap.parse_args()
    if args.smoke:
        args.params_m, args.dim, args.every, args.saves, args.warmup = 2, 256, 3, 2, 1
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_checkpoint.json").write_text(json.dumps(res, indent=1))
    md = (f"| {res['device']} {res['gpu'] or ''} | {res['params'] / 1e6:.0f}M params, "
          f"{res['checkpoint_bytes'] / 2**30:.2f} GiB | step {res['base_step_s']} s | sync stall "
          f"{res['sync_stall_s']} s | async stall {res['async_stall_s']} s | step during async "
          f"write {res['async_overlap_step_s']} s | async written in {res['async_write_s']} s |")
    (out / "async_checkpoint.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()

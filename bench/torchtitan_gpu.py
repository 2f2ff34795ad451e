"""torchtitan's own trainer and gpulaunch's ``prepare()`` side by side, same GPU, same shape, one call.

Both train Llama-3 at 8B width (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256) with as
many blocks as fit one GPU with full AdamW state (``--layers``, default 20 for an H200's 141 GB),
local batch 1 x 8192 tokens, torch.compile, selective (op-level) activation checkpointing, fused
AdamW, on random tokens; in bf16 and in FP8 (torchao float8, ``--fp8-recipe``). The runs are
interleaved (titan, ours, ours, titan, ...), each in a fresh process, so drift of the machine
(clocks, temperature) falls on both sides alike.

* torchtitan: ``torchtitan.train.Trainer`` with its llama3 model, ``parallelize_llama`` (its AC,
  compile and float8 converter), optimizer and loss, configured through its own command line;
  the only additions are a model flavour with ``--layers`` blocks and a synthetic data loader
  (registered as a train spec; its tokenizer and dataset need files this machine may lack).
* ours: ``parallel.reference_model.Llama`` of the same shape through ``prepare(strategy="auto")``
  (at one GPU: no wrapper, autocast bf16), ``compile=True``, ``activation_checkpointing="selective"``,
  ``precision="fp8"`` for FP8.

Tokens/s are timed over ``--steps`` steps after ``--warmup`` (compilation) with a CUDA sync at
both ends; MFU uses one formula for both sides (torchtitan's: 6 x non-embedding parameters + 12 x
layers x dim x seq per token, against the GPU's dense bf16 peak, also for FP8). Peak memory is
``torch.cuda.max_memory_allocated``.

    python bench/torchtitan_gpu.py --budget-s 1500 --out docs/results/torchtitan_gpu.json
    python bench/torchtitan_gpu.py --dry-run      # tiny shapes, CPU: checks both harnesses here

torchtitan 0.2.2 is the release that imports with torch 2.11 (0.3.0 needs a newer torch);
bench/torchtitan_gpu.sh carries it (bench/torchtitan_gpu_wheels.sh builds the wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
from _torchtitan_sides import flops_per_token, ours_worker, titan_argv, titan_worker  # noqa: E402

SHAPE_8B = dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, rope_theta=500000.0)
SHAPE_TINY = dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=1024, vocab_size=2048, rope_theta=500000.0)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "cpu": 1e12}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu() -> tuple[str, float]:
    try:
        import torch
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            for key, peak in PEAK_BF16.items():
                if key in name:
                    return name, peak
            return name, PEAK_BF16["H100"]
    except ImportError:
        pass
    return "cpu", PEAK_BF16["cpu"]


def run_one(side: str, precision: str, a, timeout: float) -> dict:
    """One measurement in a fresh process (fresh CUDA caching allocator, fresh compile caches)."""
    cmd = [sys.executable, __file__, "--worker", side, "--precision", precision,
           "--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--fp8-recipe", a.fp8_recipe, "--ac", a.ac] + (["--dry-run"] if a.dry_run else [])
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, timeout), env=env)
    except subprocess.TimeoutExpired as e:
        return {"side": side, "precision": precision, "error": f"timed out after {e.timeout:.0f} s"}
    wall = time.monotonic() - t0
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["wall_s"] = round(wall, 1)
            return res
    tail = (out.stdout[-1500:] + "\n" + out.stderr[-3000:]).strip()
    return {"side": side, "precision": precision, "error": f"exit {out.returncode}", "log_tail": tail,
            "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per precision")
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--sides", default="titan,ours")
    ap.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--ac", default="selective", choices=["selective", "full", "none"])
    ap.add_argument("--budget-s", type=float, default=1500, help="stop starting runs past this many seconds")
    ap.add_argument("--out", default=None, help="write every run and the summary as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, a few steps, CPU when no GPU")
    ap.add_argument("--worker", choices=["titan", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.dry_run:
        a.layers, a.seq, a.steps, a.warmup = min(a.layers, 2), min(a.seq, 256), min(a.steps, 3), min(a.warmup, 1)
    shape = dict(SHAPE_TINY if a.dry_run else SHAPE_8B, n_layers=a.layers)
    if a.worker:
        fn = titan_worker if a.worker == "titan" else ours_worker
        res = fn(a, shape)
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    gpu, peak = _gpu()
    fpt = flops_per_token(shape, a.seq)
    start = time.monotonic()
    runs, longest = [], 0.0
    sides = a.sides.split(",")
    print(f"{gpu}: {a.layers} blocks of 8B width, {a.batch} x {a.seq} tokens, AC {a.ac}, "
          f"budget {a.budget_s:.0f} s{' (dry run)' if a.dry_run else ''}", flush=True)
    print("titan command:", " ".join(titan_argv(a, "bf16")), flush=True)
    for r in range(a.rounds):
        for precision in a.precisions.split(","):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                left = a.budget_s - (time.monotonic() - start)
                if left < 1.2 * longest or left <= 0:
                    runs.append({"side": side, "precision": precision, "round": r, "skipped": "budget"})
                    continue
                res = run_one(side, precision, a, left)
                res["round"] = r
                longest = max(longest, res.get("wall_s", 0.0))
                if "tokens_per_s" in res:
                    res["mfu"] = res["tokens_per_s"] * fpt / peak
                runs.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "log_tail"}), flush=True)
                if "error" in res:
                    print(res.get("log_tail", ""), file=sys.stderr, flush=True)
    summary = summarize(runs)
    print(table(summary, gpu, a))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"gpu": gpu, "args": vars(a), "flops_per_token": fpt, "runs": runs,
                                           "summary": summary, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                          indent=1))
    ok = all("error" not in r for r in runs)
    return 0 if ok else 1


def summarize(runs: list[dict]) -> dict:
    """Best tokens/s of each side and precision (the runs are interleaved), and the ratios."""
    best: dict = {}
    for r in runs:
        if "tokens_per_s" not in r:
            continue
        key = f"{r['side']}_{r['precision']}"
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = {k: r[k] for k in ("tokens_per_s", "mfu", "peak_gib", "loss") if k in r}
    ratios = {}
    for p in ("bf16", "fp8"):
        if f"ours_{p}" in best and f"titan_{p}" in best:
            ratios[f"ours_over_titan_{p}"] = best[f"ours_{p}"]["tokens_per_s"] / best[f"titan_{p}"]["tokens_per_s"]
    for side in ("ours", "titan"):
        if f"{side}_fp8" in best and f"{side}_bf16" in best:
            ratios[f"{side}_fp8_over_bf16"] = best[f"{side}_fp8"]["tokens_per_s"] / best[f"{side}_bf16"]["tokens_per_s"]
    return {"best": best, "ratios": ratios}


def table(summary: dict, gpu: str, a) -> str:
    lines = [f"| {gpu} | tokens/s | MFU | peak GiB |", "|---|---|---|---|"]
    for key, v in sorted(summary["best"].items()):
        lines.append(f"| {key} | {v['tokens_per_s']:,.0f} | {100 * v.get('mfu', 0):.1f}% | {v.get('peak_gib', 0):.1f} |")
    lines += [f"{k}: {v:.3f}x" for k, v in summary["ratios"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

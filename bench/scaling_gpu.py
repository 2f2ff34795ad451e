"""Scaling efficiency 1 -> 2 -> 4 -> 8 GPUs for DDP and FSDP2 (issue 10, table 4).

Weak scaling: every rank keeps the same micro-batch, so ideal throughput grows linearly with the
number of GPUs. Each (strategy, GPU count) is one gpulaunch run, ``distributed(gpus=n)``, of
the same function: the Llama-shaped model of ``bench/gpu_throughput.py`` (``--model 1b`` or
``recipe``) through ``gpulaunch.parallel.prepare(strategy, mixed_precision="bf16")`` with fused
AdamW. Reported per run: the slowest rank's median step time, global tokens/s, MFU and

    efficiency(n) = tokens/s(n) / (n x tokens/s(1))

    PYTHONPATH=src python3 bench/scaling_gpu.py --out $OUT                  # every GPU count <= GPUs here
    PYTHONPATH=src python3 bench/scaling_gpu.py --smoke --out /tmp/sc       # CPU, gloo, 1 and 2 workers

Results: ``<out>/scaling.json`` and ``<out>/scaling.md``. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import gpu_throughput as gt  # bench/gpu_throughput.py: model shapes, batches, FLOPs

ROOT = Path(__file__).resolve().parents[1]


def scale_job(model_name: str, strategy: str, steps: int, warmup: int, batch: int, seq: int,
              smoke: bool) -> dict:
    """Runs on every rank (under gpulaunch)."""
    import statistics

    import torch

    from gpulaunch import runtime as rt
    from gpulaunch.parallel import prepare
    from gpulaunch.parallel.reference_model import Llama

    device = rt.init()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = gt.model_config(model_name, smoke)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    p = prepare(model, lambda params: gt._adamw(params, device, 3e-4), strategy=strategy,
                mixed_precision="bf16", micro_batch_size=batch)
    data = gt.batches(cfg, warmup + steps, batch, seq, device)
    times = []
    for i, (x, y) in enumerate(data):
        sync()
        t = time.perf_counter()
        loss = p.model(x, y)
        p.backward(loss)
        p.step()
        p.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    torch.distributed.barrier()
    return {"rank": rt.get_global_rank(), "median_step_s": statistics.median(times),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            "loss": float(loss.detach().float())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=["1b", "recipe"], default="1b")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--gpus", default=None, help="comma list of GPU counts (default: 1,2,4,8 up to what is here)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--smoke", action="store_true", help="CPU workers (gloo), tiny model, 1 and 2 workers")
    a = ap.parse_args()
    if a.smoke:
        os.environ["GPULAUNCH_FORCE_CPU"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        a.steps, a.warmup = min(a.steps, 2), min(a.warmup, 1)
    os.environ.setdefault("GPULAUNCH_QUIET", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    sys.path.insert(0, str(ROOT / "src"))
    from gpulaunch import distributed, hardware

    host = hardware.detect()
    have = len(host.gpus) if not a.smoke else 2
    counts = [int(x) for x in a.gpus.split(",")] if a.gpus else [n for n in (1, 2, 4, 8) if n <= max(have, 1)]
    bs, seq = gt.shape_defaults(a.model, a.smoke)
    bs, seq = a.batch or bs, a.seq or seq
    cfg = gt.model_config(a.model, a.smoke)
    fpt = gt.flops_per_token(cfg, seq)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    for strategy in a.strategies.split(","):
        for n in counts:
            t = time.perf_counter()
            try:
                ranks = distributed(gpus=n, stream_logs="rank0", timeout=a.timeout)(scale_job).distributed(
                    a.model, strategy, a.steps, a.warmup, bs, seq, a.smoke)
                step = max(r["median_step_s"] for r in ranks)
                tok = n * bs * seq / step
                peak = gt.peak_flops(ranks[0]["device"], a.peak_tflops)
                r = {"strategy": strategy, "gpus": n, "median_step_s": step, "tokens_per_s": tok,
                     "mfu": tok * fpt / (n * peak) if peak else None, "ranks": ranks}
            except Exception as e:  # noqa: BLE001 - a failed size is a result too
                r = {"strategy": strategy, "gpus": n, "error": f"{type(e).__name__}: {e}"[-2000:]}
            r["wall_s"] = time.perf_counter() - t
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "ranks"})[:400], flush=True)

    base = {r["strategy"]: r["tokens_per_s"] for r in results if r.get("gpus") == 1 and "tokens_per_s" in r}
    import torch
    meta = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a),
            "params": cfg.num_params(), "batch_per_rank": bs, "seq": seq,
            "total_wall_s": time.perf_counter() - t0, "command": " ".join(["python3"] + sys.argv)}
    lines = [f"Weak scaling, model {a.model} ({cfg.num_params() / 1e6:.1f} M params), micro-batch {bs} x seq "
             f"{seq} per rank, bf16, fused AdamW, launched by gpulaunch. {meta['host']}, torch "
             f"{meta['torch']}, {meta['date']}. `{meta['command']}`", "",
             "| strategy | GPUs | slowest rank's median step s | tokens/s | MFU | efficiency vs 1 GPU |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['strategy']} | {r['gpus']} | ERROR: {r['error'].splitlines()[0][:150]} | | | |")
            continue
        b = base.get(r["strategy"])
        eff = f"{r['tokens_per_s'] / (r['gpus'] * b):.3f}" if b else "—"
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "—"
        lines.append(f"| {r['strategy']} | {r['gpus']} | {r['median_step_s']:.4f} | {r['tokens_per_s']:.0f} | "
                     f"{mfu} | {eff} |")
    text = "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(text)
    (out / "scaling.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()

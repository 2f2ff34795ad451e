"""bf16 (or fp32) equivalence and peak GPU memory per strategy for a ~1B-parameter Llama-shaped model.

On ONE GPU (world size 1, NCCL) it trains the same randomly initialised model on the same
batches with: plain PyTorch (the reference, bf16 autocast + fp32 master weights, no gpulaunch),
and gpulaunch.parallel's ddp, fsdp, zero1, zero2, zero3 (ZeRO skipped, and said so, when
DeepSpeed is not importable). Each strategy runs in its own subprocess so that one's memory never
counts against another's. Results: ``<out>/parallel_gpu.json`` and ``<out>/parallel_gpu.md``.

    PYTHONPATH=src python3 bench/parallel_gpu.py --out $OUT          # ~3-5 min on one H200

Numbers are only what this script measured; nothing is filled in by hand.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["single", "ddp", "fsdp", "zero1", "zero2", "zero3"]
# bf16 is not bit-reproducible across these code paths (autocast vs bf16 parameters, different op
# orders). Over the measured steps the loss must stay within this of the reference:
BF16_ATOL = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(label: str, args) -> dict:
    """Runs inside the per-strategy subprocess. ``label`` is a strategy, or ``single#2`` for a second
    run of the reference (its distance to the first is the run-to-run noise of this GPU's kernels)."""
    import torch
    import torch.distributed as dist

    strategy = label.split("#", 1)[0]
    if args.deterministic:
        # Same inputs -> same bits: deterministic cuBLAS workspaces and kernels, and the math SDPA
        # backend (flash / memory-efficient attention backward accumulate with atomics).
        torch.use_deterministic_algorithms(True, warn_only=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sdpa_kernel([SDPBackend.MATH]).__enter__()
    mixed = None if args.precision == "fp32" else "bf16"

    sys.path.insert(0, str(ROOT / "src"))
    from gpulaunch.parallel.reference_model import LLAMA_1B, Llama, LlamaConfig

    if strategy.startswith("zero"):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return {"strategy": label, "skipped": f"deepspeed not importable: {type(e).__name__}: {e}"}

    cfg = LLAMA_1B if args.model == "1b" else LlamaConfig(vocab_size=32000, dim=512, n_layers=4, n_heads=8,
                                                          n_kv_heads=4, ffn_dim=1536, max_seq_len=1024)
    cuda = torch.cuda.is_available()  # no GPU: a CPU/gloo smoke run of this script (no memory numbers)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if cuda:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    from gpu_throughput import batches as make_batches  # bench/: the same token batches
    batches = make_batches(cfg, args.steps, args.batch, args.seq, device)

    def opt_factory(params):
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=False, foreach=True)

    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_setup = time.perf_counter()
    if strategy == "single":
        opt = opt_factory(model.parameters())

        def train_step(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed is not None):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        from gpulaunch.parallel import prepare

        p = prepare(model, opt_factory, strategy=strategy, mixed_precision=mixed,
                    activation_checkpointing=args.activation_checkpointing, micro_batch_size=args.batch)

        def train_step(x, y):
            loss = p.model(x, y)
            p.backward(loss)
            p.step()
            p.zero_grad()
            return loss
    sync()
    setup_s = time.perf_counter() - t_setup
    after_setup = torch.cuda.memory_allocated() if cuda else float("nan")

    losses, times = [], []
    for x, y in batches:
        sync()
        t = time.perf_counter()
        loss = train_step(x, y)
        losses.append(float(loss.detach().float()))
        sync()
        times.append(time.perf_counter() - t)
    steady = sorted(times[2:]) or times
    step_s = steady[len(steady) // 2]
    res = {
        "strategy": label,
        "params": n_params,
        "losses": losses,
        "device": str(device),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else float("nan"),
        "allocated_after_setup_gib": after_setup / 2 ** 30,
        "setup_s": setup_s,
        "median_step_s": step_s,
        "tokens_per_s": args.batch * args.seq / step_s,
    }
    dist.barrier()
    dist.destroy_process_group()
    return res


@functools.lru_cache(maxsize=None)
def _env_meta() -> dict:
    meta: dict = {}
    try:
        import torch

        meta.update(torch=torch.__version__)
        if torch.cuda.is_available():
            meta.update(gpu=torch.cuda.get_device_name(0),
                        gpu_mem_gib=torch.cuda.get_device_properties(0).total_memory / 2 ** 30)
        else:
            meta.update(gpu="none (CPU smoke run)", gpu_mem_gib=0.0)
    except Exception as e:  # noqa: BLE001
        meta["torch_error"] = repr(e)
    try:
        import deepspeed

        meta["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        meta["deepspeed"] = f"absent ({type(e).__name__})"
    return meta


def _report(results, args, out, t0, final):
    ref = next((r for r in results if r["strategy"] == "single" and "losses" in r), None)
    for r in results:
        if ref and "losses" in r:
            r["max_abs_loss_diff_vs_single"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
            r["trained"] = r["losses"][-1] < r["losses"][0]
    repeats = [r["max_abs_loss_diff_vs_single"] for r in results
               if r["strategy"].startswith("single#") and "max_abs_loss_diff_vs_single" in r]
    # A strategy is equivalent when it is as close to the reference as the reference is to itself
    # (run-to-run noise of non-deterministic kernels, x2), or within the fixed tolerance.
    noise = max(repeats) if repeats else 0.0
    tol = max(BF16_ATOL if args.precision == "bf16" else 1e-3, 2 * noise)
    for r in results:
        if "max_abs_loss_diff_vs_single" in r:
            r["equivalent"] = r["max_abs_loss_diff_vs_single"] <= tol
    meta = {"args": vars(args), "bf16_atol": BF16_ATOL, "reference_noise": noise, "tolerance": tol, "host": platform.node(), "python": platform.python_version(),
            "total_wall_s": time.perf_counter() - t0}
    meta.update(_env_meta())
    (out / "parallel_gpu.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))

    lines = [f"# gpulaunch.parallel on one GPU: {args.precision} equivalence and peak memory",
             "", f"GPU: {meta.get('gpu')} ({meta.get('gpu_mem_gib', 0):.0f} GiB), torch {meta.get('torch')}, "
             f"deepspeed {meta.get('deepspeed')}. Model: {args.model} "
             f"({(results[0].get('params') or 0) / 1e9:.2f} B params), micro-batch {args.batch} x seq {args.seq}, "
             f"{args.steps} AdamW steps (lr {args.lr}), {args.precision}, world size 1 (NCCL)"
             f"{', deterministic kernels + math SDPA' if args.deterministic else ''}"
             f"{', activation checkpointing' if args.activation_checkpointing else ''}.",
             f"Equivalent = max |loss - single| <= {tol:.2e} over all steps (the larger of "
             f"{BF16_ATOL if args.precision == 'bf16' else 1e-3} and twice the reference's own run-to-run "
             f"difference, {noise:.2e}).", "",
             "| strategy | peak allocated GiB | peak reserved GiB | after setup GiB | median step s | tokens/s "
             "| loss first -> last | max abs diff vs single | equivalent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "losses" in r:
            lines.append(
                f"| {r['strategy']} | {r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} | "
                f"{r['allocated_after_setup_gib']:.2f} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} | "
                f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | {r.get('max_abs_loss_diff_vs_single', float('nan')):.2e} | "
                f"{'yes' if r.get('equivalent') else 'NO'} |")
        else:
            lines.append(f"| {r['strategy']} | {'skipped: ' + r['skipped'] if 'skipped' in r else 'ERROR'} "
                         "| | | | | | | |")
    errors = [r for r in results if "error" in r]
    for r in errors:
        lines += ["", f"## {r['strategy']} error", "```", r["error"][-2000:], "```"]
    lines += ["", f"Command: `PYTHONPATH=src python3 bench/parallel_gpu.py {' '.join(sys.argv[1:])}`",
              f"Total wall time: {meta['total_wall_s']:.0f} s."]
    (out / "parallel_gpu.md").write_text("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", choices=["1b", "small"], default="1b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic kernels and math attention (isolates strategy effects from kernel noise)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=90, help="seconds per strategy")
    args = ap.parse_args()

    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # read when cuBLAS starts: set before the child runs
    results = []
    t0 = time.perf_counter()
    labels, seen = [], {}
    for s in args.strategies.split(","):
        seen[s] = seen.get(s, 0) + 1
        labels.append(s if seen[s] == 1 else f"{s}#{seen[s]}")
    for s in labels:
        cmd = [sys.executable, __file__, "--one", s, "--out", str(out), "--model", args.model,
               "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--lr", str(args.lr)]
        if args.activation_checkpointing:
            cmd.append("--activation-checkpointing")
        cmd += ["--precision", args.precision] + (["--deterministic"] if args.deterministic else [])
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                r = json.loads(lines[-1][len("RESULT "):])
            else:
                r = {"strategy": s, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}
        except subprocess.TimeoutExpired as e:
            r = {"strategy": s, "error": f"timed out after {args.timeout}s: {str(e.stderr)[-2000:] if e.stderr else ''}"}
        r["wall_s"] = time.perf_counter() - t
        results.append(r)
        _report(results, args, out, t0, final=False)  # partial results survive a kill
        print(f"{s}: {json.dumps({k: v for k, v in r.items() if k != 'losses'})[:600]}", flush=True)

    _report(results, args, out, t0, final=True)


if __name__ == "__main__":
    main()

"""Training throughput, step time, peak memory and MFU on one GPU (issue 10, table 3).

Two model shapes, both the Llama-shaped decoder of ``gpulaunch.parallel.reference_model``
(RMSNorm, RoPE, GQA through SDPA, SwiGLU), random init, bf16:

* ``recipe``: the FSDP2 transformer recipe's shape: dim 512, 4 blocks, 8 heads, MLP 4 x dim
  (SwiGLU ffn 2048), vocab 32000; micro-batch 16 x seq 1024;
* ``1b``: Llama-3.2-1B's shape (1.24 B parameters, tied embeddings); micro-batch 4 x seq 2048
  (the shape of the plain-loop bar in FINDINGS: 49-59k tok/s on an H200).

Runs, each in its own subprocess (so memory and compile caches never leak between them), world
size 1 (NCCL on a GPU, gloo in the CPU smoke mode):

    plain          hand-written loop: bf16 autocast, fused AdamW, SDPA; no gpulaunch
    plain+compile  the same with ``torch.compile(model)``
    ddp / fsdp / zero2 / zero3    ``gpulaunch.parallel.prepare(strategy=..., mixed_precision="bf16")``
                   with the same fused AdamW (ZeRO needs DeepSpeed; skipped, and said so, without)
    fsdp+compile / ddp+compile    ``torch.compile`` of the prepared model
    hf             the same shape as ``transformers.LlamaForCausalLM`` trained by a plain
                   ``Trainer`` with default settings (only bf16=True, batch size, steps, lr set)

MFU = tokens/s x FLOPs per token / peak. FLOPs per token = 6 N + 12 L d T (N: parameters in
matmuls, i.e. all but the input embedding unless it is tied to the output head; L layers,
d model width, T sequence length; the attention term counts the full T x T product, the PaLM
convention). Peak: dense bf16 of the GPU (H100/H200 989 TFLOP/s; ``--peak-tflops`` overrides).

    PYTHONPATH=src python3 bench/gpu_throughput.py --out $OUT          # ~6 min on one H200
    PYTHONPATH=src python3 bench/gpu_throughput.py --smoke --out /tmp/g  # CPU, tiny, ~1 min

A global ``--budget-s`` (default 400 s) skips the runs left when it is spent, and says so;
runs are ordered so the most important come first. Results: ``<out>/gpu_throughput.json`` and
``.md`` (rewritten after every run, so a kill keeps what was measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _proc import exit_on_sigterm, run_group  # bench/_proc.py

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUNS = {
    "1b": ["plain", "ddp", "fsdp", "zero2", "zero3", "hf", "plain+compile", "fsdp+compile"],
    "recipe": ["plain", "fsdp", "hf", "fsdp+compile"],
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                    "L4": 121.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config(name: str, smoke: bool):
    from gpulaunch.parallel.reference_model import LLAMA_1B, LlamaConfig
    if smoke:  # same code paths, sized for a 2-core CPU
        return LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=4 if name == "recipe"
                           else 2, ffn_dim=256, max_seq_len=64)
    if name == "1b":
        return LLAMA_1B
    return LlamaConfig(vocab_size=32000, dim=512, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=2048,
                       max_seq_len=1024)


def shape_defaults(name: str, smoke: bool) -> tuple[int, int]:
    if smoke:
        return 2, 64
    return (4, 2048) if name == "1b" else (16, 1024)


def flops_per_token(cfg, seq: int) -> float:
    n = cfg.num_params()
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.dim          # the input embedding is a lookup, not a matmul
    n -= cfg.n_layers * 2 * cfg.dim + cfg.dim  # norm weights
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq


def peak_flops(device_name: str | None, override: float | None) -> float | None:
    if override:
        return override * 1e12
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if device_name and key in device_name:
            return tflops * 1e12
    return None


def batches(cfg, steps: int, batch: int, seq: int, device):
    """Deterministic token batches (an arithmetic progression per row: learnable, no dataset)."""
    import torch
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10_000 + step)
        start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 8, (batch, 1), generator=g)
        s = (start + stride * torch.arange(seq + 1)) % cfg.vocab_size
        out.append((s[:, :-1].contiguous().to(device), s[:, 1:].contiguous().to(device)))
    return out


# ----------------------------------------------------------------------------- one run
def _init_world(device):
    import torch
    import torch.distributed as dist
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def _adamw(params, device, lr):
    import torch
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=fused, foreach=not fused)


def _ours(kind: str, cfg, device, args):
    """plain / compile / prepare(strategy): returns train_step(x, y) -> loss and notes."""
    import torch

    from gpulaunch.parallel.reference_model import Llama

    strategy, _, opt = kind.partition("+")
    compiled = opt == "compile"
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    notes = {"optimizer": "torch AdamW fused" if device.type == "cuda" else "torch AdamW foreach",
             "attention": "SDPA (F.scaled_dot_product_attention, causal)",
             "activation_checkpointing": False, "compile": compiled}
    if strategy == "plain":
        fwd = torch.compile(model) if compiled else model
        optim = _adamw(model.parameters(), device, args.lr)

        def step(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fwd(x, y)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            return loss
        notes["precision"] = "bf16 autocast, fp32 weights and optimizer state"
        return step, notes

    from gpulaunch.parallel import prepare
    p = prepare(model, lambda params: _adamw(params, device, args.lr), strategy=strategy,
                mixed_precision="bf16", micro_batch_size=args.batch)
    fwd = torch.compile(p.model) if compiled else p.model
    notes["precision"] = {"ddp": "bf16 autocast, fp32 weights",
                          "fsdp": "FSDP2 MixedPrecisionPolicy bf16 params, fp32 reduce and master",
                          }.get(strategy, "DeepSpeed bf16 (bf16 weights, fp32 master in optimizer)")

    def step(x, y):
        loss = fwd(x, y)
        p.backward(loss)
        p.step()
        p.zero_grad()
        return loss
    return step, notes


def _hf(cfg, device, args, bs, seq, out_dir):
    """A plain HF Trainer script with its default settings, timed by a callback."""
    import torch
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    hf_cfg = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                      num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                      rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
                      tie_word_embeddings=cfg.tie_embeddings)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg)
    data = [{"input_ids": x[i].cpu(), "labels": x[i].cpu()}
            for x, _ in batches(cfg, args.warmup + args.steps, bs, seq, "cpu") for i in range(bs)]
    cuda = device.type == "cuda"
    targs = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=bs,
                              max_steps=args.warmup + args.steps, learning_rate=args.lr,
                              bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no",
                              logging_strategy="no", disable_tqdm=True)
    times: list[float] = []
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync()
            times.append(time.perf_counter() - self.t)

    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[StepTimer()])
    out = trainer.train()
    notes = {"optimizer": getattr(targs.optim, "value", str(targs.optim)), "attention": str(model.config._attn_implementation),
             "activation_checkpointing": bool(targs.gradient_checkpointing),
             "compile": bool(targs.torch_compile), "precision": "bf16 autocast (Trainer bf16=True)"
             if cuda else "fp32", "train_loss": out.training_loss,
             "transformers": __import__("transformers").__version__}
    return times[args.warmup:], sum(p.numel() for p in model.parameters()), notes


def run_one(model_name: str, kind: str, args) -> dict:
    import torch
    sys.path.insert(0, str(ROOT / "src"))

    if kind.startswith("zero"):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return {"skipped": f"deepspeed not importable: {type(e).__name__}: {e}"}
    cfg = model_config(model_name, args.smoke)
    bs, seq = shape_defaults(model_name, args.smoke)
    bs, seq = args.batch or bs, args.seq or seq
    args.batch = bs
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    _init_world(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_setup = time.perf_counter()
    if kind == "hf":
        with tempfile.TemporaryDirectory() as tmp:
            times, n_params, notes = _hf(cfg, device, args, bs, seq, tmp)
        losses = []
    else:
        step, notes = _ours(kind, cfg, device, args)
        data = batches(cfg, args.warmup + args.steps, bs, seq, device)
        times, losses = [], []
        for i, (x, y) in enumerate(data):
            sync()
            t = time.perf_counter()
            loss = step(x, y)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
            losses.append(float(loss.detach().float()))
        n_params = cfg.num_params()
    wall = time.perf_counter() - t_setup
    step_s = statistics.median(times)
    tok_s = bs * seq / step_s
    name = torch.cuda.get_device_name(0) if cuda else None
    peak = peak_flops(name, args.peak_tflops)
    fpt = flops_per_token(cfg, seq)
    res = {"params": n_params, "batch": bs, "seq": seq, "device": name or "cpu",
           "median_step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
           "tokens_per_s": tok_s, "flops_per_token": fpt,
           "mfu": tok_s * fpt / peak if peak else None,
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None,
           "setup_and_steps_s": wall, "losses": losses, **notes}
    import torch.distributed as dist
    dist.destroy_process_group()
    return res


# ----------------------------------------------------------------------------- driver
def _meta(args) -> dict:
    meta = {"host": platform.node(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
            "command": " ".join(["python3"] + sys.argv)}
    try:
        import torch
        meta["torch"] = torch.__version__
        meta["gpu"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke
                       else "none (CPU smoke run)")
    except Exception as e:  # noqa: BLE001
        meta["torch"] = repr(e)
    for mod in ("deepspeed", "transformers"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            meta[mod] = f"absent ({type(e).__name__})"
    return meta


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "—"


def write_report(results: list[dict], meta: dict, out: Path) -> str:
    lines = [f"GPU: {meta.get('gpu')}, torch {meta.get('torch')}, deepspeed {meta.get('deepspeed')}, "
             f"transformers {meta.get('transformers')}; {meta['date']}; world size 1, bf16. "
             f"`{meta['command']}`", "",
             "| model | run | params | batch x seq | median step s | tokens/s | MFU | peak alloc GiB "
             "| peak reserved GiB | optimizer | compile | notes |", "|---" * 12 + "|"]
    for r in results:
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r["error"].strip().splitlines()[-1][:200]
            lines.append(f"| {r['model']} | {r['run']} | | | | | | | | | | "
                         f"{'skipped' if 'skipped' in r else 'ERROR'}: {why} |")
            continue
        lines.append(
            f"| {r['model']} | {r['run']} | {r['params'] / 1e6:.1f} M | {r['batch']} x {r['seq']} | "
            f"{r['median_step_s']:.4f} | {r['tokens_per_s']:.0f} | "
            f"{_fmt(r['mfu'] * 100 if r['mfu'] else None, '.1f')}{'%' if r['mfu'] else ''} | "
            f"{_fmt(r['peak_allocated_gib'], '.2f')} | {_fmt(r['peak_reserved_gib'], '.2f')} | "
            f"{r['optimizer']} | {'yes' if r['compile'] else 'no'} | {r['precision']}; "
            f"attention {r['attention']}; act. ckpt {'on' if r['activation_checkpointing'] else 'off'} |")
    lines += ["", f"Total wall time {meta.get('total_wall_s', 0):.0f} s."]
    text = "\n".join(lines) + "\n"
    (out / "gpu_throughput.md").write_text(text)
    (out / "gpu_throughput.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="1b,recipe")
    ap.add_argument("--runs", default=None,
                    help="comma list applied to every model (default: per model, see the docstring)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--budget-s", type=float, default=400, help="skip runs left after this")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], args.one[1], args)), flush=True)
        return

    exit_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    plan = []
    for m in args.models.split(","):
        runs = args.runs.split(",") if args.runs else DEFAULT_RUNS[m]
        if args.smoke and not args.runs:
            # DeepSpeed JIT-builds its CPU ops on first use (minutes) and transformers takes a
            # while to import: the smoke run checks our own paths; ask for zero*/hf explicitly.
            runs = [r for r in runs if not r.startswith(("zero", "hf"))]
        plan += [(m, r) for r in runs]
    # most important first: every model's eager runs, then the compile variants
    plan.sort(key=lambda mr: ("+compile" in mr[1]))
    meta = _meta(args)
    results: list[dict] = []
    t0 = time.perf_counter()
    log = open(out / "gpu_throughput.log", "a")
    for model_name, kind in plan:
        left = args.budget_s - (time.perf_counter() - t0)
        if left < 20:
            results.append({"model": model_name, "run": kind,
                            "skipped": f"time budget (--budget-s {args.budget_s:g}) spent"})
            continue
        cmd = [sys.executable, __file__, "--one", model_name, kind, "--out", str(out), "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr)]
        for flag, v in (("--batch", args.batch), ("--seq", args.seq), ("--peak-tflops", args.peak_tflops)):
            if v:
                cmd += [flag, str(v)]
        if args.smoke:
            cmd.append("--smoke")
        t = time.perf_counter()
        try:
            proc = run_group(cmd, env=env,
                                  timeout=min(args.timeout, max(left, 20)))
            log.write(f"===== {model_name} {kind} (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr}\n")
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            r = (json.loads(found[-1][7:]) if proc.returncode == 0 and found else
                 {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"})
        except subprocess.TimeoutExpired as e:
            log.write(f"===== {model_name} {kind} timed out\n{e.stdout}\n{e.stderr}\n")
            r = {"error": f"timed out after {e.timeout:.0f} s"}
        log.flush()
        r.update(model=model_name, run=kind, wall_s=time.perf_counter() - t)
        results.append(r)
        meta["total_wall_s"] = time.perf_counter() - t0
        write_report(results, meta, out)
        print(f"{model_name} {kind}: " + json.dumps({k: v for k, v in r.items() if k != "losses"})[:400],
              flush=True)
    meta["total_wall_s"] = time.perf_counter() - t0
    print(write_report(results, meta, out))


if __name__ == "__main__":
    main()

"""One row of ``bench/gpu_throughput.py``, run in its own process: ours, or the by-hand anchor.

A row's kind is ``base[+flag...]``:

    plain          hand-written loop over the reference model: bf16 autocast, fp32 weights,
                   fused AdamW, SDPA; no gpulaunch
    plain+bf16w    the same loop with the model's weights in bf16 and no autocast: the anchor's
                   precision (``model.to(bfloat16)``, AdamW on bf16 weights), our model
    none/ddp/fsdp/zero1/zero2/zero3    ``gpulaunch.parallel.prepare(strategy=...,
                   mixed_precision="bf16")`` with the same fused AdamW
    +compile       plain: ``torch.compile(model)``; prepare: ``prepare(compile=True)``
    +fp8           ``prepare(precision="fp8")`` (torchao float8 linears)
    +chunked       the reference model with ``chunked_loss`` (no full logits)
    anchor, anchor+compile   ``.device-carry/anchors/hf_llama_loop.py``'s own ``run()``: HF
                   ``LlamaForCausalLM``, bf16 weights, SDPA, fused AdamW; eager / compiled

Our rows read their batches from host memory through ``distributed_loader(device=...)``, or
with ``--data-source parquet`` from a Parquet file through ``gpulaunch.data.StreamingLoader``
(``bench/_data_source.py``; both: pinned host memory, non-blocking copies) and time every step from the batch fetch to ``cuda.synchronize()``;
``data_wait`` is the fetch, ``host`` the time until the host had queued the whole step: a step
whose host time is well under its step time is GPU-bound.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import statistics
import time
from pathlib import Path

from _throughput_shapes import (
    CHUNKED_LOSS_TOKENS,
    _adamw,
    batches,
    flops_per_token,
    model_config,
    peak_flops,
)

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = ROOT / ".device-carry" / "anchors" / "hf_llama_loop.py"
STRATEGIES = ("none", "ddp", "fsdp", "zero1", "zero2", "zero3")


def parse_kind(kind: str) -> tuple[str, set[str]]:
    base, *flags = kind.split("+")
    known = {"compile", "fp8", "chunked", "bf16w"}
    if base not in STRATEGIES + ("plain", "anchor") or not set(flags) <= known:
        raise ValueError(f"unknown run kind {kind!r}: base plain/anchor/{'/'.join(STRATEGIES)}, "
                         f"flags +{'/+'.join(sorted(known))}")
    return base, set(flags)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Loop:
    """One training step as three parts, so the profiler can label them."""

    def __init__(self, forward, backward, optimizer_step, notes):
        self.forward, self.backward, self.optimizer_step, self.notes = forward, backward, optimizer_step, notes

    def __call__(self, x, y):
        loss = self.forward(x, y)
        self.backward(loss)
        self.optimizer_step()
        return loss


def build_loop(base: str, flags: set[str], cfg, device, lr: float, batch: int) -> Loop:
    """The training step of one of our rows."""
    import torch

    from gpulaunch.parallel.reference_model import Llama

    compiled = "compile" in flags
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    notes = {"optimizer": "torch AdamW fused" if device.type == "cuda" else "torch AdamW foreach",
             "compile": compiled, "loss": "chunked" if cfg.chunked_loss else "plain"}
    if base == "plain":
        bf16w = "bf16w" in flags
        if bf16w:
            model.to(torch.bfloat16)
        fwd = torch.compile(model) if compiled else model
        optim = _adamw(model.parameters(), device, lr)

        def forward(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not bf16w):
                return fwd(x, y)

        def optimizer_step():
            optim.step()
            optim.zero_grad(set_to_none=True)
        notes["precision"] = ("bf16 weights and AdamW state, no autocast (the anchor's)" if bf16w
                              else "bf16 autocast, fp32 weights and optimizer state")
        return Loop(forward, lambda loss: loss.backward(), optimizer_step, notes)

    from gpulaunch.parallel import prepare
    fp8 = "fp8" in flags
    p = prepare(model, lambda params: _adamw(params, device, lr), strategy=base, mixed_precision="bf16",
                precision="fp8" if fp8 else None, compile=compiled, micro_batch_size=batch)
    notes["precision"] = {"none": "bf16 autocast, fp32 weights", "ddp": "bf16 autocast, fp32 weights",
                          "fsdp": "FSDP2 bf16 params, fp32 reduce and master",
                          }.get(base, "DeepSpeed bf16 (bf16 weights, fp32 master in optimizer)")
    if fp8:
        notes["precision"] = "FP8 linears in the blocks (torchao tensorwise), rest " + notes["precision"]

    def optimizer_step():
        p.step()
        p.zero_grad()
    return Loop(p.model, p.backward, optimizer_step, notes)


def run_ours(model_name: str, kind: str, args) -> dict:
    import torch
    import torch.distributed as dist

    base, flags = parse_kind(kind)
    if base.startswith("zero"):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return {"skipped": f"deepspeed not importable: {type(e).__name__}: {e}"}
    cfg = model_config(model_name, args.smoke, CHUNKED_LOSS_TOKENS if "chunked" in flags else 0)
    bs, seq = args.batch, args.seq
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    _init_world(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t_setup = time.perf_counter()
    try:
        step = build_loop(base, flags, cfg, device, args.lr, bs)
    except Exception as e:
        from gpulaunch.parallel import ParallelError
        if "fp8" in flags and isinstance(e, ParallelError):   # no FP8 here: prepare()'s own refusal
            dist.destroy_process_group()
            return {"skipped": str(e)}
        raise
    n = args.warmup + args.steps
    from _data_source import loader as data_loader  # bench/_data_source.py

    it, pinned = data_loader(getattr(args, "data_source", "memory"),
                             batches(cfg, n, bs, seq, "cpu"), bs, device)
    times, waits, hosts, losses = [], [], [], []
    for i in range(n):
        sync()
        t0 = time.perf_counter()
        x, y = next(it)
        t1 = time.perf_counter()
        loss = step(x, y)
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        if i >= args.warmup:
            times.append(t3 - t0)
            waits.append(t1 - t0)
            hosts.append(t2 - t0)
        losses.append(float(loss.detach().float()))
    res = _summary(cfg, bs, seq, times, cuda, args)
    res.update(data_wait_ms=statistics.median(waits) * 1e3, data_wait_max_ms=max(waits) * 1e3,
               host_ms=statistics.median(hosts) * 1e3, pinned=pinned,
               data_source=getattr(args, "data_source", "memory"),
               setup_and_steps_s=time.perf_counter() - t_setup, losses=losses, **step.notes)
    dist.destroy_process_group()
    return res


def _summary(cfg, bs, seq, times, cuda, args) -> dict:
    import torch
    step_s = statistics.median(times)
    tok_s = bs * seq / step_s
    name = torch.cuda.get_device_name(0) if cuda else None
    peak = peak_flops(name, args.peak_tflops)
    fpt = flops_per_token(cfg, seq)
    return {"params": cfg.num_params(), "batch": bs, "seq": seq, "device": name or "cpu",
            "median_step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
            "timed_steps": len(times), "tokens_per_s": tok_s, "flops_per_token": fpt,
            "mfu": tok_s * fpt / peak if peak else None,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None}


def run_anchor(model_name: str, kinds: str, args) -> dict:
    """The shared anchor script's own ``run()`` for each of ``kinds`` ("anchor", "anchor+compile",
    comma-separated), in this process, which runs nothing of ours."""
    import torch
    if not ANCHOR.exists():
        return {"error": f"{ANCHOR} is missing: run `python3 bench/carry_anchor.py` before the device "
                         "call and carry .device-carry"}
    spec = importlib.util.spec_from_file_location("hf_llama_loop", ANCHOR)
    anchor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(anchor)   # its __main__ block does not run on import
    if model_name != "1b":
        return {"skipped": "the anchor script has the 1B shape only"}
    if args.smoke or not torch.cuda.is_available():
        return {"skipped": f"the anchor script is CUDA-only (imported {ANCHOR.name}: run() present: "
                           f"{callable(getattr(anchor, 'run', None))})"}
    cfg = model_config(model_name, False)
    peak = peak_flops(torch.cuda.get_device_name(0), args.peak_tflops)
    rows = []
    for kind in kinds.split(","):
        warmup = 4   # the anchor's run() drops its first 4 steps
        t = time.perf_counter()
        r = anchor.run("compile" in parse_kind(kind)[1], args.batch, args.seq, steps=warmup + args.steps)
        tok_s, fpt = r["tok_s"], flops_per_token(cfg, r["seq"])
        rows.append({"run": kind, "params": r["params"], "batch": r["mb"], "seq": r["seq"],
                     "device": torch.cuda.get_device_name(0), "median_step_s": r["step_s"],
                     "timed_steps": args.steps, "tokens_per_s": tok_s, "flops_per_token": fpt,
                     "mfu": tok_s * fpt / peak if peak else None, "peak_allocated_gib": r["peak_gib"],
                     "peak_reserved_gib": None, "anchor_raw": r, "optimizer": "torch AdamW fused",
                     "compile": r["compile"], "loss": "HF ForCausalLMLoss", "wall_s": time.perf_counter() - t,
                     "precision": "bf16 weights and AdamW state (model.to(bfloat16))", "losses": []})
    return rows[0] if len(rows) == 1 else {"rows": rows}

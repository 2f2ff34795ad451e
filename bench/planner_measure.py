"""Measure peak GPU memory of real training steps and compare with the planner's prediction.

One command on a 1-GPU machine (see docs/planner.md for the exact line):
    python bench/planner_measure.py --out OUT_DIR
For each model size x technique (DDP, FSDP2, DeepSpeed ZeRO-3 when importable) x {full fine-tune,
LoRA} x {activation checkpointing off, on}, at world size 1 in bf16, it runs a few training steps of
a randomly initialised Hugging Face Llama built from a config, records torch.cuda.max_memory_allocated
over the steady-state steps, and writes OUT_DIR/planner_measure.json and OUT_DIR/planner_measure.md
(predicted vs measured vs error, beside Accelerate's and DeepSpeed's estimates).

--smoke runs tiny models on CPU (gloo), where the peak is the largest number of bytes held by live
tensors (bench/planner_livebytes.py): the same quantity without the CUDA allocator.

Each (model, technique) group runs in its own process so that one group's leftovers or OOM cannot
touch another's numbers; within a group the memory in use before a variant starts is subtracted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

GiB = 1 << 30
LORA_RANK = 16


def model_shapes(smoke: bool):
    from gpulaunch.planner import CATALOG, ModelShape
    if smoke:
        return {
            "tiny-a": ModelShape("tiny-a", vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8,
                                 num_kv_heads=2, head_dim=48, intermediate_size=688),
            "tiny-b": ModelShape("tiny-b", vocab_size=3000, hidden_size=384, num_layers=3, num_heads=6,
                                 num_kv_heads=6, head_dim=64, intermediate_size=1024, tie_embeddings=True),
        }
    return {"llama-125m": CATALOG["llama-125m"], "llama-3.2-1b": CATALOG["llama-3.2-1b"]}


def batch_for(name: str, smoke: bool) -> tuple[int, int]:
    if smoke:
        return 2, 256
    return (4, 2048) if name == "llama-125m" else (2, 2048)


# ----------------------------------------------------------------------------------------------
# Worker: runs in a child process, prints one JSON line per variant.
# ----------------------------------------------------------------------------------------------
def _hf_config(shape):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                       head_dim=shape.head_dim, tie_word_embeddings=shape.tie_embeddings,
                       max_position_embeddings=4096, attn_implementation="sdpa", use_cache=False)


def _enable_ac(model):
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):       # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _peak_trace(snapshot: dict, top: int = 12) -> str:
    """What was allocated, beyond what existed when recording started, at the peak of the recorded
    steps: replays the CUDA caching allocator's trace, finds the moment of the largest net growth,
    and groups the blocks live then by the Python frames that allocated them."""
    events = [e for dev in snapshot.get("device_traces", []) for e in dev]
    net = best = best_i = 0
    for i, e in enumerate(events):          # first pass: when was the net growth largest?
        if e["action"] == "alloc":
            net += e["size"]
        elif e["action"] == "free_completed":
            net -= e["size"]
        if net > best:
            best, best_i = net, i
    live: dict[int, dict] = {}              # second pass: what was live at that moment
    freed_before = 0
    for e in events[:best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed" and live.pop(e["addr"], None) is None:
            freed_before += e["size"]      # a block that existed before recording started
    def where(e):
        frames = [f for f in e.get("frames", []) if f.get("filename", "").endswith(".py")
                  and "/torch/utils/" not in f["filename"] and "/torch/nn/modules/module.py" not in f["filename"]]
        return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:4]) or "?"
    groups: dict[str, list[int]] = {}
    for e in live.values():
        g = groups.setdefault(where(e), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    lines = [f"net growth at the peak: {best / GiB:.3f} GiB (event {best_i} of {len(events)}); "
             f"blocks from before recording freed by then: {freed_before / GiB:.3f} GiB",
             f"allocation that made the peak: {events[best_i]['size'] / GiB:.3f} GiB at {where(events[best_i])}" if events else "",
             "live at the peak, allocated during the recorded steps (GiB, blocks, where):"]
    for key, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / GiB:8.3f} {n:6d}  {key}")
    return "\n".join(lines)


def _run_variant(task, variant, dev, tracker_cls):
    import torch
    from transformers import LlamaForCausalLM

    strategy, shape_d = task["strategy"], task["shape"]
    from gpulaunch.planner import ModelShape
    shape = ModelShape(**{k: (tuple(v) if k == "notes" else v) for k, v in shape_d.items()})
    mb, seq = task["micro_batch"], task["seq_len"]
    lora, ac = variant["lora"], variant["ac"]
    cuda = dev.type == "cuda"
    tracker = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    else:
        tracker = tracker_cls()
        tracker.__enter__()
        base = tracker.live
    try:
        torch.manual_seed(0)
        with torch.device(dev):
            model = LlamaForCausalLM(_hf_config(shape))
        autocast = None
        if lora:
            from peft import LoraConfig, get_peft_model
            model = model.to(torch.bfloat16)
            model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                                     target_modules="all-linear"))
            if strategy in ("fsdp", "zero3"):
                model = model.to(torch.bfloat16)   # one dtype per FSDP group; DeepSpeed casts anyway
        if ac:
            _enable_ac(model)
        engine = None
        trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
        params = trainable(model)
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            if not lora:
                autocast = torch.bfloat16                # fp32 parameters, bf16 compute
            model = DDP(model, device_ids=[dev.index] if cuda else None)
            opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        elif strategy == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            params = trainable(model)   # fully_shard replaced them with sharded DTensors
            opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        elif strategy in ("zero1", "zero2", "zero3"):
            import deepspeed
            opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
            cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": 1,
                   "bf16": {"enabled": True}, "zero_optimization": {"stage": int(strategy[-1])},
                   "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
            engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            model = engine
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, shape.vocab_size, (mb, seq), generator=g).to(dev)

        def step():
            ctx = torch.autocast(dev.type, dtype=autocast) if autocast else torch.autocast(dev.type, enabled=False)
            with ctx:
                loss = model(input_ids=x, labels=x).loss   # the output (and its logits) is not kept
            if engine is not None:
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return float(loss)

        step()                                           # creates optimizer state; not measured
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            rec_start = torch.cuda.memory_allocated()
            if task.get("trace"):
                torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        else:
            tracker.reset_peak()
        t0 = time.perf_counter()
        n = task["steps"]
        for _ in range(n):
            loss = step()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        peak = (torch.cuda.max_memory_allocated() if cuda else tracker.peak) - base
        if cuda and task.get("trace"):
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            name = f"trace-{shape.name}-{strategy}-{'lora' if lora else 'full'}{'-ac' if ac else ''}.txt"
            text = (f"{shape.name} {strategy} {'LoRA' if lora else 'full'} AC {'on' if ac else 'off'}: "
                    f"max_memory_allocated - base = {peak / GiB:.3f} GiB (base {base / GiB:.3f} GiB, "
                    f"allocated when recording started {rec_start / GiB:.3f} GiB)\n" + _peak_trace(snap))
            Path(task["out"], name).write_text(text + "\n")
        out = {"measured_peak": int(peak), "step_s": dt, "tokens_per_s": mb * seq / dt, "loss": loss,
               "trainable": sum(p.numel() for p in params)}
        if tracker is not None:
            out["measured_peak_op"] = tracker.peak_op
        model = opt = engine = params = step = None  # free them (a del would unbind the closure's names)
        return out
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
        import gc
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def worker(task_json: str) -> int:
    """One group of variants on every rank. World size 1: started directly by the parent; more GPUs:
    started by `gpulaunch run --gpus N` (torchrun's environment), and rank 0 reports the largest peak
    of any rank."""
    import torch
    import torch.distributed as dist

    task = json.loads(task_json)
    cuda = torch.cuda.is_available() and not task["smoke"]
    launched = "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0)) if launched else 0
    local = int(os.environ.get("LOCAL_RANK", 0)) if launched else 0
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if launched:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    else:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{task['store']}", rank=0,
                                world_size=1)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    tracker_cls = None
    if not cuda:
        from planner_livebytes import LiveBytes
        tracker_cls = LiveBytes
    for variant in task["variants"]:
        rec = {"variant": variant}
        try:
            rec.update(_run_variant(task, variant, dev, tracker_cls))
        except Exception as e:  # an OOM or API mismatch is a result to report, not a crash
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rec["traceback"] = traceback.format_exc()[-2000:]
        if dist.get_world_size() > 1:   # the planner predicts the per-GPU peak: compare with the largest
            peak = torch.tensor([rec.get("measured_peak", -1)], dtype=torch.float64, device=dev)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            if "measured_peak" in rec:
                rec["measured_peak"] = int(peak.item())
        if rank == 0:
            print("RESULT " + json.dumps(rec), flush=True)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: plans, launches the groups, writes the tables.
# ----------------------------------------------------------------------------------------------
def predict(shape, strategy, mb, seq, lora, ac, gpu_mem, cpu, gpus=1):
    from gpulaunch.planner import plan
    from gpulaunch.planner.memory import ALLOC_WORKSPACE
    p = plan(shape, micro_batch_size=mb, seq_len=seq, precision="bf16", lora_rank=LORA_RANK if lora else None,
             activation_checkpointing=ac, gpus_per_node=gpus, gpu_memory_bytes=gpu_mem, strategies=[strategy])
    e = p.estimate(strategy)
    peak = e.peak_allocated - (ALLOC_WORKSPACE if cpu else 0)   # no cuBLAS workspace on CPU
    return peak, e.peak_phase, {k: int(v) for k, v in e.phases.items()}


def baselines(shape, lora, gpus=1):
    from planner_baselines import accelerate_estimate, deepspeed_zero3_gpu
    P = shape.total_params + (shape.lora_params(LORA_RANK) if lora else 0)
    acc, acc_src = accelerate_estimate(P, "bfloat16")
    ds, ds_src = deepspeed_zero3_gpu(P, shape.largest_layer_params, gpus)
    return {"accelerate": acc, "accelerate_source": acc_src, "deepspeed_zero3": ds, "deepspeed_source": ds_src}


def _env():
    info = {"python": sys.version.split()[0]}
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_memory"] = torch.cuda.get_device_properties(0).total_memory
    except Exception:
        pass
    for mod in ("transformers", "peft", "accelerate", "deepspeed"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for planner_measure.json/.md")
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU (checks the whole path)")
    ap.add_argument("--strategies", default="ddp,fsdp,zero3")
    ap.add_argument("--models", default=None, help="comma list (default: both sizes)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop launching groups after this")
    ap.add_argument("--predict-only", action="store_true", help="write the predictions, run nothing")
    ap.add_argument("--gpus", type=int, default=1, help="world size (>1: ranks started by gpulaunch run)")
    ap.add_argument("--variants", default="full,full+ac,lora,lora+ac",
                    help="comma list of full, full+ac, lora, lora+ac")
    ap.add_argument("--trace", action="store_true",
                    help="GPU: also write trace-*.txt, what is live at each variant's peak and where it was allocated")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _env()
    cpu = args.smoke or "gpu" not in env
    gpu_mem = env.get("gpu_memory") or 80 * GiB
    shapes = model_shapes(args.smoke)
    if args.models:
        shapes = {k: v for k, v in shapes.items() if k in args.models.split(",")}
    strategies = args.strategies.split(",")
    names = {"full": (False, False), "full+ac": (False, True), "lora": (True, False), "lora+ac": (True, True)}
    unknown = set(args.variants.split(",")) - set(names)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(names)}")
    variants = [{"lora": lora, "ac": ac} for v, (lora, ac) in names.items() if v in args.variants.split(",")]
    t_start = time.time()
    rows = []
    for mname, shape in shapes.items():
        mb, seq = batch_for(mname, args.smoke)
        for strategy in strategies:
            group = []
            for v in variants:
                pred, phase, phases = predict(shape, strategy, mb, seq, v["lora"], v["ac"], gpu_mem, cpu, args.gpus)
                group.append({"model": mname, "params": shape.total_params, "strategy": strategy,
                              "world_size": args.gpus,
                              "micro_batch": mb, "seq_len": seq, "lora_rank": LORA_RANK if v["lora"] else None,
                              "activation_checkpointing": v["ac"], "predicted_peak": int(pred),
                              "predicted_phase": phase, "predicted_phases": phases,
                              **baselines(shape, v["lora"], args.gpus)})
            skip = None
            if strategy.startswith("zero"):
                try:
                    import deepspeed  # noqa: F401
                except Exception as e:
                    skip = f"deepspeed not importable ({type(e).__name__}); {strategy} not measured"
            if args.predict_only:
                skip = "--predict-only"
            elif time.time() - t_start > args.budget_s:
                skip = f"time budget ({args.budget_s:.0f} s) spent before this group"
            if skip is None:
                # One process per variant: memory a variant leaves behind (DDP's reducer buckets
                # outlive `del model` + gc) would count in the next one's base and be freed during
                # its steps, so its peak - base would read low (by 4.6 GiB after a 1B DDP run).
                from dataclasses import asdict
                t0, logs, results = time.time(), [], []
                for v in variants:
                    task = {"strategy": strategy, "shape": asdict(shape), "micro_batch": mb, "seq_len": seq,
                            "variants": [v], "steps": args.steps, "smoke": args.smoke,
                            "trace": args.trace, "out": str(out),
                            "store": str(out / f".store-{mname}-{strategy}-{time.time_ns()}")}
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--worker",
                           json.dumps(task)]
                    if args.gpus > 1:
                        cmd = [sys.executable, "-m", "gpulaunch.cli", "run", "--gpus", str(args.gpus), "--logs",
                               "rank0", *cmd[1:]]
                    proc = subprocess.run(cmd, capture_output=True, text=True,
                                          timeout=max(60.0, args.budget_s + 120 - (time.time() - t_start)))
                    # "RESULT {...}", or "[rank 0] RESULT {...}" when gpulaunch run streamed it
                    found = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
                             if line.startswith("RESULT ") or line.startswith("[rank 0] RESULT ")]
                    logs.append(f"===== {v} (exit {proc.returncode})\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
                    if not found:
                        break
                    results += found
                (out / f"log-{mname}-{strategy}.txt").write_text("\n".join(logs))
                if len(results) != len(group):
                    skip = f"worker exited after {len(results)} variants; see log-{mname}-{strategy}.txt"
                for row, res in zip(group, results):
                    row.update({k: v for k, v in res.items() if k != "variant"})
                print(f"{mname} {strategy}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
            for row in group:
                if "measured_peak" in row:
                    row["error_pct"] = 100.0 * (row["predicted_peak"] - row["measured_peak"]) / row["measured_peak"]
                elif "error" not in row:
                    row["skipped"] = skip or "not run"
            rows.extend(group)
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "env": env, "device": "cpu" if cpu else "cuda",
              "seconds": time.time() - t_start, "rows": rows}
    (out / "planner_measure.json").write_text(json.dumps(result, indent=2))
    (out / "planner_measure.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result) -> str:
    unit, div = ("MiB", 1 << 20) if result["device"] == "cpu" else ("GiB", GiB)
    worlds = sorted({r.get("world_size", 1) for r in result["rows"]})
    lines = [f"Command: `{result['command']}`  ", f"World size: {', '.join(map(str, worlds))}  ",
             f"Device: {result['device']}; " + ", ".join(f"{k} {v}" for k, v in result["env"].items() if k != "gpu_memory"),
             "",
             f"| model | technique | fine-tune | AC | batch x seq | predicted {unit} | measured {unit} | error % | "
             f"predicted peak during | Accelerate {unit} | DeepSpeed ZeRO-3 {unit} | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        meas = f"{r['measured_peak'] / div:.2f}" if "measured_peak" in r else ("error" if "error" in r else "skipped")
        err = f"{r['error_pct']:+.1f}" if "error_pct" in r else (r.get("error") or r.get("skipped", ""))[:80]
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else ""
        lines.append(f"| {r['model']} | {r['strategy']} | {'LoRA r=' + str(r['lora_rank']) if r['lora_rank'] else 'full'}"
                     f" | {'on' if r['activation_checkpointing'] else 'off'} | {r['micro_batch']}x{r['seq_len']} | "
                     f"{r['predicted_peak'] / div:.2f} | {meas} | {err} | {r['predicted_phase']} | "
                     f"{r['accelerate'] / div:.2f} | {r['deepspeed_zero3'] / div:.2f} | {tps} |")
    errs = [abs(r["error_pct"]) for r in result["rows"] if "error_pct" in r]
    if errs:
        lines += ["", f"{len(errs)} measured; |error| max {max(errs):.1f}%, mean {sum(errs) / len(errs):.1f}%; "
                      f"within 10%: {sum(e <= 10 for e in errs)}/{len(errs)}. Wall time {result['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

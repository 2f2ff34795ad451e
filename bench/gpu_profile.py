"""Where a training step's GPU time goes: torch.profiler over our loops and the anchor's model.

Profiles, one after another in one process (world size 1, the 1B shape, micro-batch 4 x 2048):

    hf-bf16w        HF ``LlamaForCausalLM`` built and trained as the by-hand anchor does (bf16
                    weights, SDPA, fused AdamW), eager: the loop the reference model must match
    plain+bf16w     our reference model in the same loop and precision
    plain           our plain loop: bf16 autocast over fp32 weights and AdamW state
    fsdp+compile    prepare(strategy="fsdp", mixed_precision="bf16", compile=True)
    (any row kind of bench/gpu_throughput.py, e.g. ddp+compile, through --configs)

For each: ``--warmup`` steps (compilation), ``--steps`` timed steps without the profiler, then
``--profile-steps`` steps under ``torch.profiler`` with the forward, backward and optimizer
labelled. Written under ``--out``: ``profile.md`` (per config: step time, GPU busy time, the
share of each kind of kernel, the top kernels and ops by GPU time) and ``profile.json`` (the
same numbers), and ``traces.tar.gz`` (Chrome traces, one per config; open in Perfetto).

    PYTHONPATH=/tmp/site:src python3 bench/gpu_profile.py --out $OUT/prof    # ~1.5 min, one H200
    PYTHONPATH=src python3 bench/gpu_profile.py --smoke --out /tmp/prof       # CPU, tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _throughput_rows import Loop, _init_world, build_loop, parse_kind
from _throughput_shapes import _adamw, batches, model_config, shape_defaults

CONFIGS = ["hf-bf16w", "plain+bf16w", "plain", "fsdp+compile"]   # also: ddp+compile, none+compile, ...
# kernel name -> kind, first match wins (names: cuBLAS/CUTLASS/nvjet GEMMs, flash attention,
# NCCL, inductor's fused triton kernels, ATen's element-wise and reduction templates)
KINDS = [
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm80_|ampere_|splitK|matmul"),
    ("nccl", r"nccl"),
    ("optimizer", r"adam|multi_tensor|fused_optim|foreach"),
    ("loss/softmax", r"softmax|nll_loss|cross_entropy|logsumexp"),
    ("norm", r"rms_?norm|layer_?norm"),
    ("compiled (triton)", r"^triton_|triton"),
    ("copy/cast", r"memcpy|memset|copy_|to_copy|CatArrayBatched|cast|convert"),
    ("embedding", r"embedding|index_select|indexSelect|scatter|gather|index_put"),
    ("element-wise/reduce", r"elementwise|vectorized|unrolled|reduce_kernel|Reduce"),
]


def _kind(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return kind
    return "other"


def hf_loop(cfg, device, lr: float) -> Loop:
    """The anchor's model and loop (``../shared/anchors/hf_llama_loop.py``), built on the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
                     num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                     vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len,
                     rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
                     attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf).to(torch.bfloat16)
    opt = _adamw(model.parameters(), device, lr)

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    notes = {"precision": "bf16 weights and AdamW state", "compile": False, "loss": "HF ForCausalLMLoss",
             "optimizer": "torch AdamW fused", "transformers": __import__("transformers").__version__}
    return Loop(lambda x, y: model(input_ids=x, labels=x).loss, lambda loss: loss.backward(),
                optimizer_step, notes)


def _device_time(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def summarize(prof, steps: int, cuda: bool) -> dict:
    """Kernel time by kind, per step, and the busiest kernels and ops."""
    from torch.autograd import DeviceType

    avgs = prof.key_averages()
    # kernels only: not the GPU-side spans of our own gl:: labels (they would count twice)
    kernels = [e for e in avgs if e.device_type == DeviceType.CUDA and not e.key.startswith("gl::")] if cuda else []
    busy = sum(_device_time(e) for e in kernels) / 1e3 / steps   # ms per step
    kinds: dict[str, float] = {}
    for e in kernels:
        kinds[_kind(e.key)] = kinds.get(_kind(e.key), 0.0) + _device_time(e) / 1e3 / steps
    top = sorted(kernels, key=_device_time, reverse=True)[:25]
    return {"gpu_busy_ms_per_step": busy,
            "by_kind_ms_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": e.key[:120], "kind": _kind(e.key), "calls_per_step": e.count / steps,
                             "ms_per_step": _device_time(e) / 1e3 / steps} for e in top]}


def _table(prof, cuda: bool) -> str:
    keys = ["self_device_time_total", "self_cuda_time_total"] if cuda else ["self_cpu_time_total"]
    for key in keys:   # the key's name changed across torch versions
        try:
            return prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
    return prof.key_averages().table(row_limit=30)


def profile_one(name: str, args, device, cuda: bool, trace_dir: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg = model_config("1b", args.smoke)
    bs, seq = shape_defaults("1b", args.smoke)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    if name == "hf-bf16w":
        loop = hf_loop(cfg, device, args.lr)
    else:
        base, flags = parse_kind(name)
        loop = build_loop(base, flags, cfg, device, args.lr, bs)
    data = batches(cfg, args.warmup + args.steps + args.profile_steps, bs, seq, device)

    def step(x, y):
        with record_function("gl::forward"):
            loss = loop.forward(x, y)
        with record_function("gl::backward"):
            loop.backward(loss)
        with record_function("gl::optimizer"):
            loop.optimizer_step()
        return loss

    # timed without the profiler; CUDA events split the step where the GPU reaches each part
    # (backward's kernels come from autograd's thread, so host-side labels cannot)
    times, phases = [], {"forward": [], "backward": [], "optimizer": []}
    for i, (x, y) in enumerate(data[:args.warmup + args.steps]):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else None
        sync()
        t = time.perf_counter()
        ev and ev[0].record()
        loss = loop.forward(x, y)
        ev and ev[1].record()
        loop.backward(loss)
        ev and ev[2].record()
        loop.optimizer_step()
        ev and ev[3].record()
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
            for j, k in enumerate(phases):
                if ev:
                    phases[k].append(ev[j].elapsed_time(ev[j + 1]))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for x, y in data[args.warmup + args.steps:]:
            step(x, y)
        sync()
    res = {"config": name, "median_step_ms": statistics.median(times) * 1e3, "timed_steps": len(times),
           "tokens_per_s": bs * seq / statistics.median(times), "setup_s": time.perf_counter() - t_build,
           "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
           "phases_ms_per_step": {k: statistics.median(v) for k, v in phases.items() if v},
           **loop.notes, **summarize(prof, args.profile_steps, cuda)}
    res["gpu_idle_share"] = (1 - res["gpu_busy_ms_per_step"] / res["median_step_ms"]) if cuda else None
    res["table"] = _table(prof, cuda)
    prof.export_chrome_trace(str(trace_dir / f"{name.replace('+', '_')}.json"))
    return res   # the model, its optimizer and the trace go with this frame


def write(results: list[dict], meta: dict, out: Path) -> None:
    head = ("| config | step ms | tokens/s | GPU busy ms | GPU idle | forward ms | backward ms "
            "| optimizer ms | peak GiB |")
    lines = [f"# Profiles, {meta['gpu']}, torch {meta['torch']}; {meta['date']}", "",
             f"`{meta['command']}`; 1B shape, micro-batch {meta['batch']}; times are per step.", "",
             head, "|---" * 9 + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | ERROR: {r['error'][-200:]} |" + " |" * 7)
            continue
        ph = r["phases_ms_per_step"]
        f = (lambda v, s=".1f": format(v, s) if isinstance(v, (int, float)) else "—")
        lines.append(f"| {r['config']} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{f(r['gpu_busy_ms_per_step'])} | {f(r['gpu_idle_share'] and r['gpu_idle_share'] * 100)}% | "
                     f"{f(ph.get('forward'))} | {f(ph.get('backward'))} | {f(ph.get('optimizer'))} | "
                     f"{f(r['peak_allocated_gib'], '.2f')} |")
    kinds = sorted({k for r in results if "error" not in r for k in r["by_kind_ms_per_step"]})
    lines += ["", "GPU ms per step by kind of kernel:", "",
              "| kind | " + " | ".join(r["config"] for r in results if "error" not in r) + " |",
              "|---" * (1 + sum("error" not in r for r in results)) + "|"]
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(f"{r['by_kind_ms_per_step'].get(k, 0.0):.2f}"
                                             for r in results if "error" not in r) + " |")
    for r in results:
        if "error" in r:
            continue
        lines += ["", f"## {r['config']}: top kernels", "", "| kernel | kind | calls | ms |", "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['kind']} | {k['calls_per_step']:.0f} | {k['ms_per_step']:.2f} |"
                  for k in r["top_kernels"]]
        lines += ["", f"## {r['config']}: ops (torch.profiler key_averages)", "", "```", r["table"], "```"]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    (out / "profile.json").write_text(json.dumps({"meta": meta, "results": [
        {k: v for k, v in r.items() if k != "table"} for r in results]}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps without the profiler")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--budget-s", type=float, default=120, help="skip the configs left after this")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    args = ap.parse_args()
    import torch
    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.warmup, args.steps, args.profile_steps = 1, 2, 1
    out = Path(args.out)
    trace_dir = out / "traces"
    trace_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    _init_world(device)
    meta = {"gpu": torch.cuda.get_device_name(0) if cuda else "none (CPU smoke run)", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "batch": "x".join(map(str, shape_defaults("1b", args.smoke))),
            "command": " ".join(["python3"] + sys.argv)}
    results = []
    t0 = time.perf_counter()
    for name in args.configs.split(","):
        if time.perf_counter() - t0 > args.budget_s:
            results.append({"config": name, "error": f"skipped: time budget (--budget-s {args.budget_s:g}) spent"})
            continue
        try:
            results.append(profile_one(name, args, device, cuda, trace_dir))
        except Exception:  # noqa: BLE001 - one config failing must not lose the others
            import traceback
            results.append({"config": name, "error": traceback.format_exc()[-2000:]})
        gc.collect()   # free the config's model before the next one is built
        print(f"{name}: {json.dumps({k: v for k, v in results[-1].items() if k not in ('table', 'top_kernels')})[:600]}",
              flush=True)
        meta["wall_s"] = time.perf_counter() - t0
        write(results, meta, out)
    with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:   # one file back instead of five
        for f in sorted(trace_dir.glob("*.json")):
            tar.add(f, arcname=f.name)
            f.unlink()
    trace_dir.rmdir()
    print((out / "profile.md").read_text()[:3000])


if __name__ == "__main__":
    main()

"""Training throughput on one GPU against the by-hand anchor, in one call (issue 20, table 3).

The anchor is ``../shared/anchors/hf_llama_loop.py`` (HF ``LlamaForCausalLM``, bf16 weights,
SDPA, fused AdamW), copied into the ignored ``.device-carry/anchors/`` by
``python3 bench/carry_anchor.py`` and run by its own ``run()`` in a process of its own. Our rows
(see ``bench/_throughput_rows.py`` for the kinds) use ``gpulaunch.parallel.reference_model``
(shapes in ``bench/_throughput_shapes.py``), each in its own process, world size 1.

The default plan interleaves the anchor around our rows, A B ... B A, so that a drift of the
machine during the call shows as a difference between the two anchor measurements; every row is
reported as a ratio to the mean of the two ``anchor+compile`` rows, and the issue's targets are
checked at the end of the table.

    python3 bench/carry_anchor.py                                             # once, here
    PYTHONPATH=/tmp/site:src python3 bench/gpu_throughput.py --out $OUT       # <= 3.5 min, one H200
    PYTHONPATH=src python3 bench/gpu_throughput.py --smoke --out /tmp/g       # CPU, tiny, ~2 min

``--budget-s`` skips the rows left once it is spent (and says so); the rows are ordered so that
the anchor's second pair still runs. Results: ``<out>/gpu_throughput.{md,json,log}``, rewritten
after every row, so a kill keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from _proc import exit_on_sigterm, run_group  # bench/_proc.py
from _throughput_shapes import (  # noqa: F401 - re-exported for scaling_gpu.py / parallel_gpu.py
    PEAK_BF16_TFLOPS,
    _adamw,
    batches,
    flops_per_token,
    model_config,
    peak_flops,
    shape_defaults,
)

ROOT = Path(__file__).resolve().parents[1]
FIRST = [("1b", "anchor,anchor+compile")]   # one anchor process, two rows
# most important first: rows past the time budget are skipped (and said so), the closing anchor
# pair keeps its time
OURS = [("1b", "ddp+compile"), ("1b", "fsdp+compile"), ("1b", "fsdp+compile+fp8"), ("1b", "plain+bf16w"),
        ("recipe", "plain+compile"), ("recipe", "fsdp+compile"), ("1b", "none+compile"),
        ("1b", "fsdp+compile+chunked")]
LAST = [("1b", "anchor+compile,anchor")]
# runs where DeepSpeed is importable and time is left; zero3+compile: each block one ZeRO-3
# unit, compiled (H100, 2026-12-07: 0.803x the compiled anchor; docs/choosing-a-technique.md)
OPTIONAL = [("1b", "zero2+compile"), ("1b", "zero3+compile")]
# (row, reference row, target ratio, what the issue asks)
TARGETS = [("1b ddp+compile", "1b anchor+compile", 1.10, "prepare()+compile, DDP >= 1.1x anchor compiled"),
           ("1b fsdp+compile", "1b anchor+compile", 1.10, "prepare()+compile, FSDP2 >= 1.1x anchor compiled"),
           ("1b plain+bf16w", "1b anchor", 1.00, "eager reference model >= anchor eager (same precision)"),
           ("1b plain", "1b anchor", 1.00, "eager reference model, autocast + fp32 master, vs anchor eager"),
           ("1b fsdp+compile+fp8", "1b fsdp+compile", 1.25, "FP8 >= 1.25x our bf16 compiled"),
           ("recipe fsdp+compile", "recipe plain+compile", 0.90, "recipe shape: prepare(compile) >= 0.9x plain+compile")]


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
    from importlib import metadata
    for mod in ("deepspeed", "transformers", "torchao"):   # versions without importing them
        try:
            meta[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:
            meta[mod] = "absent"
    return meta


def _fmt(v, spec, suffix=""):
    return format(v, spec) + suffix if isinstance(v, (int, float)) else "—"


def _anchor_ref(results, run: str):
    vals = [r["tokens_per_s"] for r in results if r["model"] == "1b" and r["run"] == run and "tokens_per_s" in r]
    return sum(vals) / len(vals) if vals else None


def _targets(results) -> list[str]:
    rows = {f"{r['model']} {r['run']}": r for r in results if "tokens_per_s" in r}
    out = []
    for name, ref, want, what in TARGETS:
        if name not in rows:
            continue
        base = _anchor_ref(results, ref.split(" ", 1)[1]) if "anchor" in ref else rows.get(ref, {}).get("tokens_per_s")
        if not base:
            continue
        got = rows[name]["tokens_per_s"] / base
        out.append(f"| {what} | {name} / {ref} | {got:.3f} | {want:.2f} | {'met' if got >= want else 'NOT met'} |")
    return out


def write_report(results: list[dict], meta: dict, out: Path) -> str:
    ref = _anchor_ref(results, "anchor+compile")
    lines = [(f"GPU: {meta.get('gpu')}, torch {meta.get('torch')}, torchao {meta.get('torchao')}, deepspeed "
             f"{meta.get('deepspeed')}, transformers {meta.get('transformers')}; {meta['date']}; world size 1. "
             f"`{meta['command']}`"), "",
             ("| model | run | params | batch x seq | median step s | tokens/s | x anchor compiled | MFU "
             "| data wait ms | host ms | peak alloc GiB | precision | notes |"), "|---" * 13 + "|"]
    for r in results:
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r["error"].strip().splitlines()[-1][:200]
            lines.append(f"| {r['model']} | {r['run']} |" + " |" * 10
                         + f" {'skipped' if 'skipped' in r else 'ERROR'}: {why} |")
            continue
        ratio = r["tokens_per_s"] / ref if ref and r["model"] == "1b" else None
        lines.append(
            f"| {r['model']} | {r['run']} | {r['params'] / 1e6:.1f} M | {r['batch']} x {r['seq']} | "
            f"{r['median_step_s']:.4f} | {r['tokens_per_s']:.0f} | {_fmt(ratio, '.3f')} | "
            f"{_fmt(r['mfu'] * 100 if r['mfu'] else None, '.1f', '%')} | {_fmt(r.get('data_wait_ms'), '.2f')} | "
            f"{_fmt(r.get('host_ms'), '.1f')} | {_fmt(r['peak_allocated_gib'], '.2f')} | {r['precision']} | "
            f"{r['optimizer']}; compile {'yes' if r['compile'] else 'no'}; loss {r['loss']}; "
            f"{r.get('timed_steps')} timed steps |")
    targets = _targets(results)
    if targets:
        lines += ["", "| target | ratio of | measured | wanted | |", "|---|---|---|---|---|", *targets]
    fp8 = {r["run"]: r["losses"] for r in results if r["model"] == "1b" and r.get("losses")}
    if "fsdp+compile+fp8" in fp8 and "fsdp+compile" in fp8:
        d = max(abs(a - b) for a, b in zip(fp8["fsdp+compile+fp8"], fp8["fsdp+compile"]))
        lines += ["", (f"FP8 vs bf16 (fsdp+compile), same init and batches: max |loss difference| over "
                      f"{len(fp8['fsdp+compile'])} steps = {d:.4f} (losses {fp8['fsdp+compile'][0]:.3f} -> "
                      f"{fp8['fsdp+compile'][-1]:.3f}).")]
    lines += ["", f"Total wall time {meta.get('total_wall_s', 0):.0f} s."]
    text = "\n".join(lines) + "\n"
    (out / "gpu_throughput.md").write_text(text)
    (out / "gpu_throughput.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return text


def _plan(args) -> list[tuple[str, str, bool]]:
    """(model, run, closing): closing marks the anchor pair that ends the interleave."""
    models = args.models.split(",")
    if args.runs:   # the given runs for every model, in order (the anchor only if asked)
        return [(m, r, False) for m in models for r in args.runs.split(",")]
    plan = [(m, r, False) for m, r in FIRST + OURS] + [(m, r, True) for m, r in LAST]
    plan += [(m, r, False) for m, r in OPTIONAL if not args.smoke]   # zero*: DeepSpeed JIT-builds on CPU
    return [p for p in plan if p[0] in models]


def child(model: str, kind: str, args) -> dict:
    from _throughput_rows import run_anchor, run_ours
    bs, seq = shape_defaults(model, args.smoke)
    args.batch, args.seq = args.batch or bs, args.seq or seq
    return (run_anchor if kind.startswith("anchor") else run_ours)(model, kind, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="1b,recipe")
    ap.add_argument("--runs", default=None, help="comma list for every model (default: the interleaved plan)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (compile happens here)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--budget-s", type=float, default=210, help="skip the rows left after this")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per row")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 timed steps")
    ap.add_argument("--data-source", default="memory", choices=("memory", "parquet"),
                    help="our rows' batches: host memory, or a Parquet file through "
                         "gpulaunch.data.StreamingLoader (bench/_data_source.py)")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.one:
        print("RESULT " + json.dumps(child(args.one[0], args.one[1], args)), flush=True)
        return

    exit_on_sigterm()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "bench")]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    plan = _plan(args)
    meta = _meta(args)
    results: list[dict] = []
    t0 = time.perf_counter()
    with open(out / "gpu_throughput.log", "a") as log:
        for i, (model_name, kind, closing) in enumerate(plan):
            left = args.budget_s - (time.perf_counter() - t0)
            # keep ~60 s for the closing anchor pair: when time runs short, our rows are skipped first
            reserve = 0 if closing else 60 * sum(1 for p in plan[i:] if p[2])
            if left - reserve < 15:
                results += [{"model": model_name, "run": k, "skipped": f"time budget (--budget-s {args.budget_s:g}) spent"}
                            for k in kind.split(",")]
                continue
            cmd = [sys.executable, __file__, "--one", model_name, kind, "--out", str(out), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr)]
            for flag, v in (("--batch", args.batch), ("--seq", args.seq), ("--peak-tflops", args.peak_tflops)):
                if v:
                    cmd += [flag, str(v)]
            if args.smoke:
                cmd.append("--smoke")
            cmd += ["--data-source", args.data_source]
            t = time.perf_counter()
            try:
                proc = run_group(cmd, env=env, timeout=min(args.timeout, max(left, 15)))
                log.write(f"===== {model_name} {kind} (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr}\n")
                found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                r = (json.loads(found[-1][7:]) if proc.returncode == 0 and found else
                     {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"})
            except subprocess.TimeoutExpired as e:
                log.write(f"===== {model_name} {kind} timed out\n{e.stdout}\n{e.stderr}\n")
                r = {"error": f"timed out after {e.timeout:.0f} s"}
            log.flush()
            wall = time.perf_counter() - t
            # an anchor process measures a pair; its error or skip stands for both
            rows = r.pop("rows", None) or [{**r, "run": k} for k in kind.split(",")]
            for row in rows:
                row.setdefault("wall_s", wall)
                row["model"] = model_name
                results.append(row)
                print(f"{model_name} {row['run']}: " + json.dumps({k: v for k, v in row.items() if k != "losses"})[:400],
                      flush=True)
            meta["total_wall_s"] = time.perf_counter() - t0
            write_report(results, meta, out)
    meta["total_wall_s"] = time.perf_counter() - t0
    print(write_report(results, meta, out))


if __name__ == "__main__":
    main()

"""The fast TRL recipes against the by-hand anchors, interleaved in one device call: Llama-3.2-1B
shape, random init, bf16, world size 1, 4 x 2048 tokens a step (``--data long``), tokens/s of
the steady steps and the ratio to the anchor measured in the same call.

Groups (one device call each; ``--group all`` runs them in order while the budget lasts):

- ``lora``: the compiled LoRA anchor (``anchors/hf_lora_loop.py``: peft r 8 all-linear, fused
  AdamW) first and last (A ... A), between them ``trl_sft_lora_ddp`` and ``trl_sft_lora_fsdp``
  with ``--speed auto`` and the anchor's own loop with ``gpulaunch.hf.fuse_lora`` (merged form),
  after the second anchor ``trl_sft_lora_ddp`` without compiling (``-x compile=false``) and the
  split fused form, if the budget allows. Target: recipe / anchor >= 1.0 (stretch 1.3).
- ``full``: the compiled full fine-tuning anchor (``anchors/hf_llama_loop.py``) first and last,
  between them ``trl_sft_full_zero3`` with ``--speed auto`` (tuned ZeRO-3 dict) and ``--speed
  off`` (the seed's dict), each under gpulaunch and under ``accelerate launch --use_deepspeed``,
  and the seed's dict under gpulaunch with ``OMP_NUM_THREADS=1`` (what accelerate launch sets).
  Targets: auto / accelerate(off) >= 1.0, auto / anchor >= 0.8.
- ``quality``: ``trl_sft_lora_ddp`` and ``trl_sft_lora_fsdp`` with ``--speed off``, the same
  steps and seed: each fast run's final eval loss must be within 2% of its plain twin's (the
  ZeRO-3 pair is in ``full``).
- ``frameworks``: Unsloth's LoRA recipe and the TRL LoRA recipe on the same model (Llama-3.2-3B),
  shape and adapter, both with tokens counted from the batches each step fetched; needs
  ``.device-carry/llm-frameworks.tar.xz`` (``bash bench/llm_frameworks_bundle.sh``) carried too.
- ``gptoss``: ``trl_sft_lora_ddp`` on gpt-oss-20b (random init, bf16, 2048 tokens, LoRA r 8
  all-linear, mb 1 x ga 2), no anchor: the seed's settings (``--speed off``, the phase-2 row's
  arguments: gradient checkpointing, eager attention; 3,312 tokens/s on an H200 on 2026-12-03)
  against ``--speed auto`` (sink attention through SDPA, grouped_mm experts, compiled layers,
  no checkpointing where the planner fits it), same steps and seed, eval loss within 2%; then,
  while the budget lasts, ``--speed auto`` with ``-x compile=false``, with mb 2 x ga 1 (the
  same tokens a step) and with transformers' flex attention (sinks through its log-sum-exp;
  CUDA only, not in the smoke). Target: fast / plain >= 2.0.
- ``qlora``: Axolotl's QLoRA recipe and ``trl_sft_lora_ddp --load-in-4bit`` on the same model
  (OLMo-3-7B), shape (2 x 2048 tokens, 4 micro-batches a step) and adapter (4-bit nf4 base,
  LoRA r 32 all-linear), no checkpointing in either, tokens counted from the fetched batches in
  both; then, with the budget's slack, the TRL row with Liger, and with its layers compiled.
  Needs ``.device-carry/llm-frameworks.tar.xz`` too (Axolotl's tree; bitsandbytes for TRL).
- ``table``: the speed table's rows alone, in one call: the ``lora`` group's anchors and
  recipes, the ``quality`` twins, the ``full`` group's anchors, ``zero3_fast`` and the seed's
  recipe under ``accelerate launch`` (its loss check's plain twin too). About 490 s on an H200,
  660 s on a slow H100 host (which does not fit one 10-minute call).
- ``foundry``: LLM Foundry's full fine-tune (Composer's trainer; at world size 1 Foundry drops
  its FSDP config) and the TRL full recipe as DDP on the ``full`` group's shape, tokens counted
  from the fetched batches in both; needs
  ``.device-carry/llm-foundry.tar.xz`` (``bash bench/llm_foundry_bundle.sh``) carried too.

    python bench/llm_speed.py --carry                   # here: copy the anchors to .device-carry
    bash bench/llm_speed.sh                             # there (GPU): GROUP=lora|full|quality
    python bench/llm_speed.py --dry-run                 # the plan and every command, nothing run
    python bench/llm_speed.py --smoke --group lora      # CPU, tiny models: checks this script

Writes ``$OUT/llm_speed.json`` (every run's full result, ratios, loss checks) and
``$OUT/llm_speed.md`` (the table for recipes/LLM.md), rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import llm_recipes_gpu as recipes_bench  # noqa: E402  (Run, execute, shapes: one launcher code)
from _llm_speed_plans import foundry_plan, gptoss_plan, qlora_plan  # noqa: E402

ROOT = HERE.parent
GROUPS = ("lora", "full", "quality", "frameworks", "gptoss", "qlora", "foundry")
LOSS_TOLERANCE = 0.02
RESULTS_DIR, LOG_DIR = Path("/tmp/llm-speed-results"), Path("/tmp/llm-speed-logs")
# the speed table (recipes/LLM.md), in run order (A B B A per anchor): not one of GROUPS,
# so ``all`` does not run these rows twice
TABLE = ("anchor_lora_1", "lora_ddp_fast", "lora_fsdp_fast", "anchor_lora_2", "lora_ddp_plain",
         "lora_fsdp_plain", "anchor_full_1", "zero3_fast", "zero3_plain_accelerate",
         "anchor_full_2")
# a run that exists only to be compared with these: pointless once they were all skipped
COMPARED_WITH = {"lora_ddp_plain": ("lora_ddp_fast",),
                 "lora_fsdp_plain": ("lora_fsdp_fast", "lora_fsdp_fast_reshard"),
                 "zero3_plain_accelerate": ("zero3_fast", "zero3_plain"),
                 "zero3_fast_accelerate": ("zero3_fast",)}


@dataclass
class Item:
    label: str
    group: str
    row: str
    est_s: float
    recipe: recipes_bench.Run | None = None      # a recipe run, or
    anchor: list = field(default_factory=list)   # bench/llm_anchor_run.py arguments
    role: str = ""                               # anchor_lora, fast, plain, ...


def _recipe(label, group, recipe, args, *, role, row, est_s, launcher="gpulaunch", smoke=False,
            env=None, site="trl"):
    accel = ["--mixed_precision", "no" if smoke else "bf16"] if launcher == "accelerate" else []
    run = recipes_bench.Run(label, recipe, args, launcher=launcher, limit_s=2 * est_s + 60,
                            est_s=est_s, row=row, group=group, launcher_args=accel,
                            extra_env=dict(env or {}), site=site)
    return Item(label, group, row, est_s, recipe=run, role=role)


def _profile_args(label: str, smoke: bool) -> list[str]:
    """16 steps (the last flags win), steps 12-14 profiled with Python stacks, the report
    beside the run's logs (in the call's llm-speed-logs.tar.gz)."""
    steps, at = ("4", "2:1") if smoke else ("16", "12:3")
    return ["--max-steps", steps, "--eval-steps", steps, "-x", f"profile={at}",
            "-x", "profile_stack=true", "-x", f"profile_dir={LOG_DIR / label}"]


def plan(group: str, smoke: bool) -> list[Item]:
    steps = 4 if smoke else 40
    one_b = recipes_bench._shape(smoke, "llama-3.2-1b", 2048, 4, 1, steps, "--measure-after",
                                 "8", "--eval-batches", "2", "--lr", "2e-4",
                                 "--warmup-steps", "2") + ["-x", "save=false"]
    lora = ["--lora-r", "8", "--lora-alpha", "16", "--lora-dropout", "0"]
    fsdp_cpu = ["-x", "on_cpu=ddp"] if smoke else []
    plain = ["--speed", "off", "--no-gradient-checkpointing"]
    smoke_flag = ["--smoke"] if smoke else []

    def anchor(label, kind, fuse="none", role="anchor"):
        return Item(label, group, f"by hand, {kind}" + (f", fuse_lora {fuse}" if fuse != "none"
                                                         else "") + ", torch.compile",
                    90, anchor=["--kind", kind, "--compile", "--fuse", fuse, *smoke_flag],
                    role=role)

    if group == "lora":
        return [anchor("anchor_lora_1", "lora", role="anchor_lora"),
                _recipe("lora_ddp_fast", group, "trl_sft_lora_ddp", one_b + lora, role="fast",
                        row="trl_sft_lora_ddp --speed auto", est_s=90, smoke=smoke),
                _recipe("lora_fsdp_fast", group, "trl_sft_lora_fsdp", one_b + lora + fsdp_cpu,
                        role="fast", row="trl_sft_lora_fsdp --speed auto", est_s=90, smoke=smoke),
                # FSDP2 resharding each layer after forward, as the seed's dict does (--speed auto
                # keeps them gathered with one process): what that choice is worth
                _recipe("lora_fsdp_fast_reshard", group, "trl_sft_lora_fsdp",
                        one_b + lora + fsdp_cpu + ["-x", "reshard_after_forward=true"],
                        role="variant", smoke=smoke, est_s=70,
                        row="trl_sft_lora_fsdp --speed auto -x reshard_after_forward=true"),
                anchor("fused_merged", "lora", "merged", role="fused"),
                anchor("anchor_lora_2", "lora", role="anchor_lora"),
                # --speed auto without compiling (Liger's kernels instead): is compiling the
                # layers worth it on this GPU?
                _recipe("lora_ddp_eager", group, "trl_sft_lora_ddp",
                        one_b + lora + ["-x", "compile=false"], role="variant",
                        row="trl_sft_lora_ddp --speed auto -x compile=false", est_s=60,
                        smoke=smoke),
                anchor("fused_split", "lora", "split", role="fused")]    # last: the budget's slack
    if group == "full":
        z3 = one_b
        return [anchor("anchor_full_1", "full", role="anchor_full"),
                _recipe("zero3_fast", group, "trl_sft_full_zero3", z3, role="fast",
                        row="trl_sft_full_zero3 --speed auto (tuned ZeRO-3, each layer one "
                        "ZeRO-3 unit, compiled)", est_s=70, smoke=smoke),
                # what compiling the layers as ZeRO-3 units adds, in the same call
                _recipe("zero3_fast_eager", group, "trl_sft_full_zero3",
                        z3 + ["-x", "compile=false"], role="variant", smoke=smoke,
                        row="trl_sft_full_zero3 --speed auto -x compile=false", est_s=60),
                _recipe("zero3_plain", group, "trl_sft_full_zero3", z3 + plain, role="plain",
                        row="trl_sft_full_zero3 --speed off (the seed's ZeRO-3 dict)", est_s=50,
                        smoke=smoke),
                _recipe("zero3_plain_accelerate", group, "trl_sft_full_zero3", z3 + plain,
                        role="accelerate", launcher="accelerate", smoke=smoke,
                        row="the same under accelerate launch --use_deepspeed", est_s=50),
                # the one launch-environment difference found statically: accelerate launch
                # sets OMP_NUM_THREADS=1 (its --num_cpu_threads_per_process default), torchrun
                # and gpulaunch leave it unset for a single process
                _recipe("zero3_plain_omp1", group, "trl_sft_full_zero3", z3 + plain,
                        role="plain_omp1", env={"OMP_NUM_THREADS": "1"}, smoke=smoke,
                        row="--speed off under gpulaunch with OMP_NUM_THREADS=1", est_s=50),
                _recipe("zero3_fast_accelerate", group, "trl_sft_full_zero3", z3,
                        role="accelerate_fast", launcher="accelerate", smoke=smoke,
                        row="--speed auto under accelerate launch --use_deepspeed", est_s=60),
                # one GPU: ZeRO-3 shards nothing; the same recipe as plain DDP (compiled
                # layers, fused AdamW) is what one process can do, against the same anchor
                _recipe("full_ddp_fast", group, "trl_sft_full_zero3",
                        z3 + ["-x", "technique=ddp"], role="variant", smoke=smoke,
                        row="trl_sft_full_zero3 --speed auto -x technique=ddp", est_s=60),
                # ZeRO-3 in the anchor's precision: bf16 master weights and AdamW state
                _recipe("zero3_fast_bf16", group, "trl_sft_full_zero3",
                        z3 + ["-x", "master=bf16"], role="variant", smoke=smoke,
                        row="trl_sft_full_zero3 --speed auto -x master=bf16", est_s=70),
                # DeepSpeed's throughput timer back on (its default): two device syncs a step,
                # what --speed auto turns off
                _recipe("zero3_fast_timers_on", group, "trl_sft_full_zero3",
                        z3 + ["-x", "ds.timers.throughput.enabled=true"], role="variant",
                        smoke=smoke, est_s=70,
                        row="... -x ds.timers.throughput.enabled=true (DeepSpeed's default)"),
                # one rank: no gradient reduce to overlap, so no side stream and its events
                _recipe("zero3_fast_no_overlap", group, "trl_sft_full_zero3",
                        z3 + ["-x", "ds.zero_optimization.overlap_comm=false"], role="variant",
                        smoke=smoke, est_s=70,
                        row="... -x ds.zero_optimization.overlap_comm=false"),
                anchor("anchor_full_2", "full", role="anchor_full"),
                # where the step's time goes (llm_common.step_profile): short runs of their
                # own, profiled after warm-up; no tokens/s from them
                *[_recipe(f"{name}_profile", group, "trl_sft_full_zero3",
                          z3 + extra + _profile_args(f"{name}_profile", smoke), role="profile",
                          smoke=smoke, row=f"{row}, steps 12-14 profiled", est_s=50)
                  for name, extra, row in (
                      ("zero3_fast", [], "trl_sft_full_zero3 --speed auto"),
                      ("zero3_fast_bf16", ["-x", "master=bf16"], "... -x master=bf16"),
                      ("full_ddp_fast", ["-x", "technique=ddp"], "... -x technique=ddp"))]]
    if group == "quality":
        return [_recipe("lora_ddp_plain", group, "trl_sft_lora_ddp", one_b + lora + plain,
                        role="plain", row="trl_sft_lora_ddp --speed off", est_s=50, smoke=smoke),
                _recipe("lora_fsdp_plain", group, "trl_sft_lora_fsdp",
                        one_b + lora + plain + fsdp_cpu, role="plain",
                        row="trl_sft_lora_fsdp --speed off", est_s=50, smoke=smoke)]
    if group == "frameworks":
        # Unsloth's LoRA (its own patched step and gradient checkpointing) beside the TRL LoRA
        # recipe on the same model, shape and adapter: Llama-3.2-3B, 2 x 2048 tokens, 4
        # micro-batches a step, LoRA r 16 alpha 16 on all seven projections. Tokens are counted
        # from the batches each optimizer step fetched in both (``token_counter``).
        three_b = recipes_bench._shape(smoke, "llama-3.2-3b", 2048, 2, 4, 4 if smoke else 16,
                                       "--measure-after", "4", "--eval-batches", "1",
                                       "--lr", "2e-4", "--warmup-steps", "2") + ["-x", "save=false"]
        r16 = ["--lora-r", "16", "--lora-alpha", "16", "--lora-dropout", "0"]
        return [_recipe("unsloth_3b", group, "unsloth_sft_lora_ddp", three_b + r16,
                        role="framework", site="unsloth", smoke=smoke, est_s=80,
                        row="unsloth_sft_lora_ddp Llama-3.2-3B (Unsloth's step and checkpointing)"),
                _recipe("trl_lora_3b", group, "trl_sft_lora_ddp", three_b + r16,
                        role="framework_twin", smoke=smoke, est_s=70,
                        row="trl_sft_lora_ddp --speed auto, the same model, shape and adapter")]
    if group == "table":
        by = {i.label: i for g in ("lora", "quality", "full") for i in plan(g, smoke)}
        return [by[label] for label in TABLE]
    if group == "gptoss":
        return gptoss_plan(smoke, _recipe, recipes_bench._shape)
    if group == "qlora":
        return qlora_plan(smoke, _recipe, recipes_bench._shape)
    if group == "foundry":
        return foundry_plan(smoke, _recipe, recipes_bench._shape)
    raise SystemExit(f"--group {group!r}: use one of {', '.join(GROUPS)}, table or all")


def anchor_command(item: Item, json_path: Path) -> list[str]:
    return [sys.executable, str(HERE / "llm_anchor_run.py"), *item.anchor, "--json", str(json_path)]


def run_anchor(item: Item, res_dir: Path, log_dir: Path, deadline: float) -> dict:
    out_json, log = res_dir / f"{item.label}.json", log_dir / f"{item.label}.log"
    out_json.unlink(missing_ok=True)
    cmd = anchor_command(item, out_json)
    limit = max(10.0, min(2 * item.est_s + 60, deadline - time.time()))
    env = {**os.environ, **recipes_bench.site_env("trl")}
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=limit, start_new_session=True, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = {"label": item.label, "row": item.row, "group": item.group, "rc": rc,
           "wall_s": round(time.time() - t0, 2),
           "command": shlex.join(["python3" if c == sys.executable else c for c in cmd])}
    if out_json.exists():
        r = json.loads(out_json.read_text())
        out["result"] = {**r, "steady_tokens_per_second": r.get("tok_s")}
    else:
        out["log_tail"] = log.read_text()[-3000:]
    print(f"=== {item.label}: rc {rc}, {out['wall_s']} s, tok/s "
          f"{out.get('result', {}).get('tok_s')}", flush=True)
    return out


def _rate(run):
    return (run.get("result") or {}).get("steady_tokens_per_second")


def _median_rate(run):
    """Tokens/s at the median steady step (mean tokens of a steady step / median step time):
    a few stalled steps in a short window move it little, where they move the mean rate much
    (the TRL QLoRA row of 2026-12-07: 0.87x Axolotl by the mean, 0.99x by the median step)."""
    import statistics
    x = run.get("result") or {}
    times, toks = x.get("step_times") or [], x.get("step_tokens") or []
    skip = x.get("warmup_steps_skipped") or 0
    times, toks = times[skip:], toks[skip:]
    if not times or len(times) != len(toks):
        return None
    return (sum(toks) / len(toks)) / statistics.median(times)


def _mean(vals):
    vals = [v for v in vals if v]
    return sum(vals) / len(vals) if vals else None


def ratios(runs: list[dict]) -> dict:
    """Every ratio the issue asks for, from the runs that finished (None where one is missing)."""
    by = {r["label"]: r for r in runs}
    anchor_lora = _mean([_rate(r) for r in runs if r.get("role") == "anchor_lora"])
    anchor_full = _mean([_rate(r) for r in runs if r.get("role") == "anchor_full"])

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    out = {"anchor_lora_tokens_per_second": anchor_lora,
           "anchor_full_tokens_per_second": anchor_full}
    for label in ("lora_ddp_fast", "lora_fsdp_fast", "fused_merged", "fused_split",
                  "lora_ddp_eager", "lora_fsdp_fast_reshard"):
        out[f"{label}_vs_anchor_lora"] = ratio(_rate(by.get(label, {})), anchor_lora)
    z = {k: _rate(by.get(k, {})) for k in ("zero3_fast", "zero3_plain", "zero3_plain_accelerate",
                                           "zero3_fast_accelerate", "zero3_plain_omp1")}
    out["zero3_fast_vs_accelerate_plain"] = ratio(z["zero3_fast"], z["zero3_plain_accelerate"])
    out["zero3_fast_vs_accelerate_fast"] = ratio(z["zero3_fast"], z["zero3_fast_accelerate"])
    out["zero3_plain_accelerate_vs_plain"] = ratio(z["zero3_plain_accelerate"], z["zero3_plain"])
    out["zero3_fast_vs_plain"] = ratio(z["zero3_fast"], z["zero3_plain"])
    out["zero3_plain_omp1_vs_plain"] = ratio(z["zero3_plain_omp1"], z["zero3_plain"])
    out["zero3_fast_vs_anchor_full"] = ratio(z["zero3_fast"], anchor_full)
    out["zero3_fast_vs_eager"] = ratio(z["zero3_fast"], _rate(by.get("zero3_fast_eager", {})))
    out["trl_lora_3b_vs_unsloth_3b"] = ratio(_rate(by.get("trl_lora_3b", {})),
                                             _rate(by.get("unsloth_3b", {})))
    for label in ("trl_qlora", "trl_qlora_liger", "trl_qlora_compiled"):
        out[f"{label}_vs_axolotl_qlora"] = ratio(_rate(by.get(label, {})),
                                                 _rate(by.get("axolotl_qlora", {})))
        out[f"{label}_vs_axolotl_qlora_median_step"] = ratio(
            _median_rate(by.get(label, {})), _median_rate(by.get("axolotl_qlora", {})))
    out["trl_full_1b_vs_foundry_1b"] = ratio(_rate(by.get("trl_full_1b", {})),
                                             _rate(by.get("foundry_1b", {})))
    out["full_ddp_fast_vs_anchor_full"] = ratio(_rate(by.get("full_ddp_fast", {})), anchor_full)
    for label in ("zero3_fast_bf16", "zero3_fast_timers_on", "zero3_fast_no_overlap"):
        out[f"{label}_vs_anchor_full"] = ratio(_rate(by.get(label, {})), anchor_full)
    plain = _rate(by.get("gptoss_plain", {}))
    for label in ("gptoss_fast", "gptoss_fast_mb2", "gptoss_fast_eager", "gptoss_fast_flex"):
        out[f"{label}_vs_plain"] = ratio(_rate(by.get(label, {})), plain)
    return out


def loss_checks(runs: list[dict]) -> dict:
    """Fast vs plain final eval loss, same steps and seed: within LOSS_TOLERANCE (relative)."""
    by = {r["label"]: (r.get("result") or {}).get("eval_loss_after") for r in runs}
    if by.get("zero3_plain") is None:   # the seed's recipe under accelerate launch: the same run
        by["zero3_plain"] = by.get("zero3_plain_accelerate")
    out = {}
    for fast, plain in (("lora_ddp_fast", "lora_ddp_plain"), ("lora_fsdp_fast", "lora_fsdp_plain"),
                        ("lora_fsdp_fast_reshard", "lora_fsdp_plain"),
                        ("zero3_fast", "zero3_plain"), ("zero3_fast_bf16", "zero3_plain"),
                        ("zero3_fast_no_overlap", "zero3_plain"),
                        ("gptoss_fast", "gptoss_plain"),
                        ("gptoss_fast_mb2", "gptoss_plain"), ("gptoss_fast_eager", "gptoss_plain"),
                        ("gptoss_fast_flex", "gptoss_plain")):
        a, b = by.get(fast), by.get(plain)
        if a is not None and b is not None:
            rel = abs(a - b) / abs(b)
            out[fast] = {"fast": a, "plain": b, "relative": round(rel, 4),
                         "ok": rel <= LOSS_TOLERANCE}
    return out


def markdown(summary: dict) -> str:
    rat, checks = summary["ratios"], summary["loss_checks"]
    lines = [f"{summary['when']}, {summary['machine']}, `{summary['command']}`", "",
             "| run | tokens/s (steady) | vs anchor | MFU | peak GiB | eval loss end | technique "
             "| rc |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        x = r.get("result") or {}
        vs = rat.get(f"{r['label']}_vs_anchor_lora")
        if f"{r['label']}_vs_anchor_full" in rat:                 # the full fine-tunes
            vs = rat[f"{r['label']}_vs_anchor_full"]
        if r["label"].startswith("gptoss_fast"):                  # no anchor: vs the seed's
            vs = rat.get(f"{r['label']}_vs_plain")
        if r["label"].startswith("trl_qlora"):                    # vs Axolotl's QLoRA
            vs = rat.get(f"{r['label']}_vs_axolotl_qlora")
        if r["label"] == "trl_full_1b":                           # vs LLM Foundry's
            vs = rat.get("trl_full_1b_vs_foundry_1b")
        rate, mfu, peak = (x.get(k) for k in ("steady_tokens_per_second", "mfu",
                                              "peak_memory_gib"))
        lines.append(f"| {r['row']} (`{r['label']}`) | {round(rate) if rate else '-'} | "
                     f"{vs if vs is not None else '-'} | "
                     f"{f'{100 * mfu:.1f}%' if mfu else '-'} | {f'{peak:.1f}' if peak else '-'} | "
                     f"{x.get('eval_loss_after', x.get('loss', '-'))} | "
                     f"{x.get('technique', 'by hand')} | {r['rc']} |")
    lines += ["", "Ratios: " + json.dumps({k: v for k, v in rat.items() if v is not None}),
              "", "Loss checks (fast vs plain, same steps, within 2%): " + json.dumps(checks)]
    hits = {r["label"]: (((r.get("result") or {}).get("speed") or {})
                         .get("recompile_limit_hits") or {}).get("value") for r in summary["runs"]}
    hits = {label: v for label, v in hits.items() if v is not None}
    if hits:   # compiled recipe runs: frames Dynamo gave up on (eager from then on)
        lines += ["", "Frames past Dynamo's recompile limit (should be empty): " + json.dumps(hits)]
    return "\n".join(lines) + "\n"


def carry() -> int:
    dest = ROOT / ".device-carry" / "anchors"
    dest.mkdir(parents=True, exist_ok=True)
    import llm_anchor_run
    for kind, name in llm_anchor_run.ANCHORS.items():
        src = llm_anchor_run.find_anchor(kind)
        if src.parent != dest:
            shutil.copyfile(src, dest / name)
        print(f"{src} -> {(dest / name).relative_to(ROOT)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group", default=os.environ.get("GROUP", "all"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, few steps")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--carry", action="store_true", help="copy the anchors to .device-carry")
    ap.add_argument("--only", default="", help="comma list of run labels")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", "540")))
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "out-llm-speed")))
    args = ap.parse_args(argv)
    if args.carry:
        return carry()
    groups = GROUPS if args.group == "all" else tuple(args.group.split(","))
    items = [i for g in groups for i in plan(g, args.smoke)]
    if args.only:
        items = [i for i in items if i.label in set(args.only.split(","))]
    # the split fused form is the budget's slack: with several groups in one call it goes last
    items.sort(key=lambda i: i.label == "fused_split")
    res_dir, log_dir = RESULTS_DIR, LOG_DIR
    if args.dry_run:
        for i in items:
            cmd = (recipes_bench.command(i.recipe, res_dir / f"{i.label}.json") if i.recipe
                   else anchor_command(i, res_dir / f"{i.label}.json"))
            env = " ".join(f"{k}={v}" for k, v in (i.recipe.extra_env if i.recipe else {}).items())
            print(f"[{i.group}] {i.label} (~{i.est_s:.0f} s): {i.row}\n    "
                  f"{env + ' ' if env else ''}{shlex.join(cmd)}")
        print(f"{len(items)} runs, ~{sum(i.est_s for i in items):.0f} s estimated")
        return 0
    out = Path(args.out)
    for d in (out, res_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget_s
    summary = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": shlex.join(["python3", "bench/llm_speed.py", *(argv or sys.argv[1:])]),
               "machine": "CPU smoke (numbers mean nothing)" if args.smoke else "GPU",
               "versions": recipes_bench.versions(), "runs": [], "skipped": []}
    gpu = (summary["versions"].get("trl") or {}).get("gpu") if isinstance(
        summary["versions"].get("trl"), dict) else None
    summary["machine"] = gpu or summary["machine"]
    anchorless: set[str] = set()    # groups whose first anchor was skipped for the budget
    planned = {i.label for i in items}
    for item in items:
        if item.recipe is not None and not recipes_bench.available(item.recipe.site):
            summary["skipped"].append({"run": item.label, "why": "framework not carried "
                                       f"(LLM_SITE_{item.recipe.site.upper()} unset)"})
            print(f"--- skipped {item.label}: {item.recipe.site} not carried", flush=True)
            continue
        if item.group in anchorless and not item.role.startswith("anchor"):
            # its ratios need the anchor that did not run: the time goes to nothing else
            summary["skipped"].append({"run": item.label, "why": "budget: no anchor in its group"})
            print(f"--- skipped {item.label}: its group's anchor did not run", flush=True)
            continue
        partners = [p for p in COMPARED_WITH.get(item.label, ()) if p in planned]
        if partners and not any(r["label"] in partners for r in summary["runs"]):
            # every run it would be compared with was skipped: its time would buy nothing
            summary["skipped"].append({"run": item.label, "why": "budget: its partners "
                                       f"({', '.join(partners)}) did not run"})
            print(f"--- skipped {item.label}: {', '.join(partners)} did not run", flush=True)
            continue
        if time.time() + 0.75 * item.est_s > deadline and not args.smoke:
            summary["skipped"].append({"run": item.label, "why": "budget"})
            print(f"--- skipped {item.label}: budget", flush=True)
            if item.role.startswith("anchor") and not any(
                    r["role"] == item.role for r in summary["runs"]):
                anchorless.add(item.group)
            continue
        if item.recipe is not None:
            r = recipes_bench.execute(item.recipe, res_dir, log_dir, deadline)
        else:
            r = run_anchor(item, res_dir, log_dir, deadline)
        r["role"] = item.role
        summary["runs"].append(r)
        summary["ratios"], summary["loss_checks"] = ratios(summary["runs"]), loss_checks(summary["runs"])
        summary["elapsed_s"] = round(time.time() - t0, 1)
        (out / "llm_speed.json").write_text(json.dumps(summary, indent=1, default=str))
        (out / "llm_speed.md").write_text(markdown(summary))
    print(markdown(summary) if summary["runs"] else "nothing ran", flush=True)
    return 0 if all(r["rc"] == 0 for r in summary["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

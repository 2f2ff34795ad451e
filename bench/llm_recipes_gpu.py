"""The six LLM recipes on one GPU at real sequence length (issue 19), planned for two device
calls of at most 8 minutes each; ``bench/llm_recipes_gpu.sh`` installs the carried wheels and
runs this with ``--phase 1`` or ``--phase 2``.

Phase 1, launcher parity (Llama-3.2-1B shape, random init, ``--data long``: 4 x 2048 real
tokens a step, 16 steps, the first 4 left out as warm-up): one warm-up run first (the first
process on a fresh machine pays cold caches), then for each TRL recipe the same command under
gpulaunch (A) and torchrun (B) in the order A B B A; for ZeRO-3 also ``accelerate launch`` (C,
its DeepSpeed launcher) once in the middle: A B C B A. Ratio: gpulaunch's steady-state
training tokens/s over torchrun's (mean of the As over mean of the Bs), beside each command's
wall time and start-up seconds.

Phase 2, real-shape rows: gpt-oss-20b LoRA under DDP, Axolotl OLMo-3-7B QLoRA (4-bit base
through bitsandbytes), Unsloth Llama-3.2-3B LoRA, the gpt-oss-120b recipe's LoRA (experts
adapted, FSDP2) on a 4-layer gpt-oss at its real width, and the DDP full fine-tune at 1B (beside
ZeRO-3, with save, export check and reload); then any parity group phase 1 had no time for.

Every run has its own time limit inside a global budget; a group that no longer fits is
skipped and said so. After every run ``$OUT/summary-phase<N>.json`` / ``.md`` and
``logs-phase<N>.tar.gz`` are rewritten, so a cut-short call keeps what was measured.
``--smoke``: the same plan on CPU with tiny models and few steps (checks this script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS, LOGS = Path("/tmp/llm-results"), Path("/tmp/llm-logs")   # kept on a warm machine


@dataclass
class Run:
    label: str
    recipe: str
    args: list[str]
    launcher: str = "gpulaunch"       # gpulaunch | torchrun | accelerate
    site: str = "trl"                 # which carried packages go on PYTHONPATH
    limit_s: float = 120.0            # this run's own time limit
    est_s: float = 60.0               # expected wall time (to skip what cannot fit)
    row: str = ""                     # what the row of the table is
    group: str = ""                   # parity group
    extra_env: dict = field(default_factory=dict)
    launcher_args: list = field(default_factory=list)   # after the launcher, before the script


def _shape(smoke: bool, arch: str, seq: int, mb: int, ga: int, steps: int, *more) -> list[str]:
    if smoke:   # tiny model, CPU, 1 rank: the same code paths in a few seconds of training
        keep, skip = [], 0
        for m in more:   # the smoke shape's own settings win over the real run's
            if skip:
                skip -= 1
            elif m in ("--measure-after", "--eval-batches", "--lr", "--warmup-steps"):
                skip = 1
            else:
                keep.append(m)
        return ["--arch", arch, "--gpus", "1", "--data", "long", "--seq-len", "256",
                "--batch-size", "2", "--grad-accum", "1", "--max-steps", "4",
                "--measure-after", "1", "--eval-steps", "4", "--eval-batches", "1",
                "--report-to", "none", *keep]
    return ["--arch", arch, "--full", "--gpus", "1", "--data", "long", "--seq-len", str(seq),
            "--batch-size", str(mb), "--grad-accum", str(ga), "--max-steps", str(steps),
            "--eval-steps", str(steps), "--logging-steps", "5", "--report-to", "none", *more]


def plan(phase: int, smoke: bool) -> list[list[Run]]:
    """Groups of runs; a group runs whole or not at all. Estimates (``est_s``) are guesses for
    the H200 from the 2026-12 runs (start-up ~20-25 s a process), used only to skip a group
    that would not finish inside the budget."""
    s = smoke
    # LLM_PARITY_STEPS: longer parity runs (the default 16 steps measure ~3 s of training on an
    # H200: the 2026-12-04 run's repeats under one launcher differed by up to 12%)
    steps = int(os.environ.get("LLM_PARITY_STEPS", "16"))
    one_b = _shape(s, "llama-3.2-1b", 2048, 4, 1, steps, "--measure-after",
                   str(max(4, steps // 8)), "--eval-batches", "1",
                   "--no-gradient-checkpointing", "--lr", "2e-4", "--warmup-steps", "2")
    est = 32 + max(0, steps - 16) * 0.6
    lora = ["--lora-r", "8", "--lora-alpha", "16", "--lora-dropout", "0"]
    fsdp_cpu = ["-x", "on_cpu=ddp"] if smoke else []
    nosave = ["-x", "save=false"]
    parity = []
    for recipe, args, with_accel in (
            ("trl_sft_lora_ddp", one_b + lora + nosave, False),
            ("trl_sft_full_zero3", one_b + nosave, True),
            ("trl_sft_lora_fsdp", one_b + lora + nosave + fsdp_cpu, False)):
        # A B B A; with accelerate launch (C) once in the middle: A B C B A
        with_accel = with_accel and not os.environ.get("LLM_PARITY_NO_ACCELERATE")
        order = ["A", "B", "C", "B", "A"] if with_accel else ["A", "B", "B", "A"]
        launchers = {"A": "gpulaunch", "B": "torchrun", "C": "accelerate"}
        # accelerate launch: the precision the recipe's DeepSpeed dict has (bf16 on a GPU)
        accel = ["--mixed_precision", "no" if smoke else "bf16"]
        parity.append([Run(f"parity_{recipe}_{i}{x}", recipe, args, launcher=launchers[x],
                           limit_s=100 + 2 * est, est_s=est, group=recipe,
                           row=f"parity {launchers[x]}",
                           launcher_args=accel if x == "C" else [])
                       for i, x in enumerate(order)])
    if phase == 1:
        warmup = Run("warmup_lora_ddp_1b", "trl_sft_lora_ddp", one_b + lora + nosave,
                     limit_s=150, est_s=40, row="warm-up (first process on the machine: cold "
                                                "caches); not part of any ratio")
        return [[warmup], *parity]
    big = [] if smoke else ["--attn", "eager"]          # gpt-oss: no SDPA in transformers
    rows = [
        [Run("gpt_oss_20b_lora_ddp", "trl_sft_lora_ddp",
             _shape(s, "gpt-oss-20b", 2048, 1, 2, 8, "--measure-after", "2", "--eval-batches",
                    "1", "--gradient-checkpointing", *big, *nosave), limit_s=170, est_s=70,
             row="gpt-oss-20b LoRA r8 (all linear), DDP at world size 1, the seed's mb 1 x ga 2")],
        [Run("axolotl_olmo3_7b_qlora", "axolotl_qlora_ddp",
             _shape(s, "olmo-3-7b", 2048, 2, 4, 6, "--measure-after", "2", "--eval-batches",
                    "1", "--gradient-checkpointing"), site="axolotl", limit_s=200, est_s=130,
             row="OLMo-3-7B QLoRA (4-bit base, bitsandbytes) r32, Axolotl, DDP, mb 2 x ga 4")],
        [Run("unsloth_llama3b_lora", "unsloth_sft_lora_ddp",
             _shape(s, "llama-3.2-3b", 2048, 2, 4, 6, "--measure-after", "2", "--eval-batches",
                    "1", "--gradient-checkpointing", *nosave), site="unsloth", limit_s=170,
             est_s=80, row="Llama-3.2-3B LoRA r16, Unsloth, DDP, mb 2 x ga 4")],
        [Run("gpt_oss_4l_expert_lora_fsdp2", "trl_sft_lora_fsdp",
             _shape(s, "gpt-oss-120b", 2048, 1, 4, 6, "--layers", "2" if s else "4",
                    "--measure-after", "2", "--eval-batches", "1", *big, *nosave, *fsdp_cpu),
             limit_s=170, est_s=70, row="gpt-oss-120b settings (LoRA r32 + experts r8), FSDP2, "
                                        "4 of 36 layers at the real width (128 experts)")],
        [Run("ddp_full_1b", "trl_sft_full_zero3", one_b + ["-x", "technique=ddp"], limit_s=120,
             est_s=45, row="DDP full fine-tune, Llama-3.2-1B (beside ZeRO-3; with save, "
                           "export check and reload)")],
    ]
    # parity groups phase 1 could not fit: run here if the budget allows (skipped when their
    # results are already on this machine, i.e. phase 1 ran them on it)
    return rows + [[dataclasses.replace(r, label=r.label + "_p2") for r in g] for g in parity
                   if not all((RESULTS / f"{r.label}.json").exists() for r in g)]


def python_for(site: str) -> str:
    """The interpreter of a run: this one (the GPU image's, with the site's packages on
    PYTHONPATH), or a framework's own venv (``LLM_PYTHON_<SITE>``, the CPU smoke run)."""
    return os.environ.get(f"LLM_PYTHON_{site.upper()}") or sys.executable


def command(run: Run, results: Path) -> list[str]:
    script = f"recipes/{run.recipe}.py"           # runs from the repository root
    py = python_for(run.site)
    head = {"gpulaunch": [py],
            "torchrun": [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                         "1"],
            # accelerate's DeepSpeed launcher: one process through torchrun, with Accelerate's
            # DeepSpeed environment (the recipe's own ZeRO-3 dict is what configures it)
            "accelerate": [py, "-m", "accelerate.commands.launch", "--use_deepspeed",
                           "--zero_stage", "3", "--num_processes", "1", "--num_machines", "1"],
            }[run.launcher]
    return [*head, *run.launcher_args, script, *run.args, "--results", str(results),
            "--output", f"/tmp/llm-out/{run.label}"]


def site_env(site: str) -> dict:
    """PYTHONPATH of a run: the repository, then the carried packages of its framework
    (``LLM_SITE_<NAME>``, set by the .sh), which shadow what the host has."""
    parts = [str(ROOT / "src"), str(ROOT / "recipes")]
    parts += [p for p in os.environ.get(f"LLM_SITE_{site.upper()}", "").split(":") if p]
    return {"PYTHONPATH": ":".join(parts)}


def execute(run: Run, res_dir: Path, log_dir: Path, deadline: float) -> dict:
    results = res_dir / f"{run.label}.json"
    log = log_dir / f"{run.label}.log"
    limit = max(10.0, min(run.limit_s, deadline - time.time()))
    cmd = command(run, results)
    py = python_for(run.site)
    env = {**os.environ, **site_env(run.site), **run.extra_env}
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=limit, start_new_session=True, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    subprocess.run(["rm", "-rf", f"/tmp/llm-out/{run.label}"], check=False)
    out = {"label": run.label, "recipe": run.recipe, "launcher": run.launcher, "row": run.row,
           "group": run.group, "rc": rc, "wall_s": round(wall, 2), "limit_s": round(limit),
           "command": shlex.join(["python3" if c == py else c for c in cmd])}
    if results.exists():
        out["result"] = json.loads(results.read_text())
    else:
        out["log_tail"] = log.read_text()[-3000:]
    r = out.get("result", {})
    print(f"=== {run.label}: rc {rc}, {wall:.1f} s; technique {r.get('technique')}, "
          f"steady tok/s {_f(r.get('steady_tokens_per_second'))}, MFU {_f(r.get('mfu'), 4)}, "
          f"peak {_f(r.get('peak_memory_gib'))} GiB, eval {_f(r.get('eval_loss_before'))} -> "
          f"{_f(r.get('eval_loss_after'))}", flush=True)
    if rc != 0:
        print(log.read_text()[-2500:], flush=True)
    return out


def _f(v, nd=1):
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, (int, float)) else str(v))


def parity(runs: list[dict]) -> dict:
    """Per parity group: gpulaunch / torchrun (and / accelerate) of steady tokens/s, wall and
    start-up seconds, from the A, B (and C) runs that finished."""
    out = {}
    for group in sorted({r["group"] for r in runs if r["group"]}):
        by = {}
        for r in runs:
            if r["group"] == group and r.get("result"):
                by.setdefault(r["launcher"], []).append(r)

        def mean(launcher, key, inner=True, by=by):
            vals = [(x["result"].get(key) if inner else x.get(key)) for x in by.get(launcher, [])]
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else None

        def startup(launcher, by=by):
            vals = [x["result"].get("time_split", {}).get("startup_s") for x in by.get(launcher, [])]
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else None

        g = {"runs": {k: len(v) for k, v in by.items()}}
        for other in ("torchrun", "accelerate"):
            a, b = mean("gpulaunch", "steady_tokens_per_second"), mean(other, "steady_tokens_per_second")
            if a and b:
                g[f"tokens_per_second_ratio_vs_{other}"] = a / b
                g[f"wall_s_gpulaunch_vs_{other}"] = [mean("gpulaunch", "wall_s", False),
                                                    mean(other, "wall_s", False)]
                g[f"startup_s_gpulaunch_vs_{other}"] = [startup("gpulaunch"), startup(other)]
        g["steady_tokens_per_second"] = {k: [x["result"].get("steady_tokens_per_second")
                                             for x in v] for k, v in by.items()}
        out[group] = g
    return out


def markdown(runs: list[dict], par: dict, phase: int) -> str:
    lines = [f"### Phase {phase}", "",
             ("| run | technique in effect | seq x mb x ga, fill | steady tokens/s | MFU | peak GiB "
              "| eval loss start -> end | start-up / eval / save / total s | rc |"),
             "|---" * 9 + "|"]
    for r in runs:
        x = r.get("result", {})
        ts = x.get("time_split", {})
        lines.append(
            f"| {r['label']} | {x.get('technique', '-')} ({x.get('wrapper', '-')}) | "
            f"{x.get('seq_len', '-')} x {x.get('micro_batch', '-')} x {x.get('grad_accum', '-')}, "
            f"{_f(x.get('fill'), 3)} | {_f(x.get('steady_tokens_per_second'), 0)} | "
            f"{_f(100 * x['mfu'] if x.get('mfu') else None)}{'%' if x.get('mfu') else ''} | "
            f"{_f(x.get('peak_memory_gib'))} | "
            f"{_f(x.get('eval_loss_before'), 3)} -> {_f(x.get('eval_loss_after'), 3)} | "
            f"{_f(ts.get('startup_s'))} / {_f(ts.get('eval_s'))} / {_f(ts.get('save_s'))} / "
            f"{_f(ts.get('total_s'))} | {r['rc']} |")
    for g, v in par.items():
        for other in ("torchrun", "accelerate"):
            if f"tokens_per_second_ratio_vs_{other}" in v:
                w, s = v[f"wall_s_gpulaunch_vs_{other}"], v[f"startup_s_gpulaunch_vs_{other}"]
                lines.append(f"\n{g}: gpulaunch / {other} steady tokens/s = "
                             f"{v[f'tokens_per_second_ratio_vs_{other}']:.3f} "
                             f"(runs {v['runs']}); wall {_f(w[0])} vs {_f(w[1])} s, "
                             f"start-up {_f(s[0])} vs {_f(s[1])} s")
    lines += ["", "Commands (one per run):", ""] + [f"- `{r['label']}`: `{r['command']}`"
                                                      for r in runs]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", type=int, choices=(1, 2), required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", "430")))
    ap.add_argument("--only", default="", help="comma list of run labels (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "out-llm")))
    args = ap.parse_args(argv)
    out = Path(args.out)
    res_dir, log_dir = RESULTS, LOGS / f"phase{args.phase}"
    if args.phase == 1:          # a fresh start; phase 2 reads what phase 1 left (warm machine)
        subprocess.run(["rm", "-rf", str(RESULTS), str(LOGS)], check=False)
    for d in (out, res_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget_s
    groups = plan(args.phase, args.smoke)
    if args.only:
        keep = set(args.only.split(","))
        groups = [[r for r in g if r.label in keep] for g in groups]
        groups = [g for g in groups if g]
    summary = {"phase": args.phase, "smoke": args.smoke, "versions": versions(),
               "budget_s": args.budget_s, "runs": [], "skipped": []}
    for group in groups:
        missing = [r.label for r in group if not available(r.site)]
        if missing:
            summary["skipped"].append({"runs": missing, "why": "framework not carried "
                                       "(LLM_SITE_<NAME> / LLM_PYTHON_<NAME> unset)"})
            print(f"--- skipped {missing}: framework not carried", flush=True)
            continue
        need = sum(60.0 if args.smoke else r.est_s for r in group)
        if time.time() + 0.75 * need > deadline:   # rough estimates; a cut run still tells
            summary["skipped"].append({"runs": [r.label for r in group],
                                       "why": f"budget: {deadline - time.time():.0f} s left, "
                                              f"group needs ~{need:.0f} s"})
            print(f"--- skipped {[r.label for r in group]}: budget", flush=True)
            continue
        for run in group:
            summary["runs"].append(execute(run, res_dir, log_dir, deadline))
            summary["parity"] = parity(summary["runs"])
            summary["elapsed_s"] = round(time.time() - t0, 1)
            write(out, summary, log_dir)
    write(out, summary, log_dir)
    return 0


def available(site: str) -> bool:
    """Whether a framework's packages came (site tree) or its venv is named (smoke)."""
    return site == "trl" or bool(os.environ.get(f"LLM_SITE_{site.upper()}")
                                 or os.environ.get(f"LLM_PYTHON_{site.upper()}"))


def versions() -> dict:
    code = ("import importlib, json, torch\nv = {'torch': torch.__version__, 'cuda': "
            "torch.cuda.is_available(), 'gpu': torch.cuda.get_device_name(0) if "
            "torch.cuda.is_available() else None}\nfor m in ('transformers', 'trl', 'peft', "
            "'accelerate', 'datasets', 'deepspeed', 'unsloth', 'axolotl', 'bitsandbytes',\n"
            "          'llmfoundry', 'composer'):\n"
            "    try:\n        v[m] = importlib.import_module(m).__version__\n"
            "    except Exception as e:\n        v[m] = 'missing: ' + type(e).__name__\n"
            "print(json.dumps(v))")
    out = {}
    for site in ("trl", "unsloth", "axolotl", "foundry"):
        if site != "trl" and not available(site):
            continue
        p = subprocess.run([python_for(site), "-c", code], env={**os.environ, **site_env(site)},
                           capture_output=True, text=True, timeout=120, check=False)
        out[site] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
            p.stderr[-800:]
    return out


def write(out: Path, summary: dict, log_dir: Path) -> None:
    phase = summary["phase"]
    (out / f"summary-phase{phase}.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / f"summary-phase{phase}.md").write_text(
        markdown(summary["runs"], summary.get("parity", {}), phase))
    with tarfile.open(out / f"logs-phase{phase}.tar.gz", "w:gz") as tar:
        tar.add(log_dir, arcname=f"logs-phase{phase}")


if __name__ == "__main__":
    sys.exit(main())

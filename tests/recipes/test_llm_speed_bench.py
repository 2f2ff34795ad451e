"""bench/llm_speed.py without a GPU: its plan and commands (--dry-run), the ratio and loss-check
arithmetic on hand-made results, and one real anchor row through its CPU mirror (--smoke)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PY, ROOT, python_env

sys.path.insert(0, str(ROOT / "bench"))
import llm_speed  # noqa: E402


def _bench(*args, timeout=300):
    env = python_env({"PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
                      "GPULAUNCH_FORCE_CPU": "1"})
    return subprocess.run([PY, str(ROOT / "bench" / "llm_speed.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_lists_every_group_interleaved_with_its_anchor():
    p = _bench("--dry-run")
    assert p.returncode == 0, p.stderr
    labels = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("[")]
    assert labels[0] == "anchor_lora_1" and "anchor_lora_2" in labels       # A ... A
    assert labels.index("anchor_full_1") < labels.index("zero3_fast") < labels.index("anchor_full_2")
    # the profiled runs come after the timed ones and never count: 16 steps, 12-14 profiled
    prof = [line for line in p.stdout.splitlines() if "-x profile=12:3" in line]
    assert len(prof) == 3 and all("--max-steps 16" in line and "profile_stack=true" in line
                                  for line in prof)
    assert labels.index("anchor_full_2") < labels.index("zero3_fast_profile")
    # the two DeepSpeed-key variants sit between the anchors, each with its -x ds. override
    for label, flag in (("zero3_fast_timers_on", "-x ds.timers.throughput.enabled=true"),
                        ("zero3_fast_no_overlap", "-x ds.zero_optimization.overlap_comm=false")):
        assert labels.index("anchor_full_1") < labels.index(label) < labels.index("anchor_full_2")
        assert flag in p.stdout
    # FSDP2's own choice measured against the seed's resharding, between the LoRA anchors
    assert labels.index("anchor_lora_1") < labels.index("lora_fsdp_fast_reshard") < labels.index("anchor_lora_2")
    assert "-x reshard_after_forward=true" in p.stdout
    assert "--use_deepspeed" in p.stdout and "--speed off" in p.stdout
    assert "--seq-len 2048 --batch-size 4" in p.stdout and "--full" in p.stdout
    assert "38 runs" in p.stdout and "zero3_fast_bf16" in labels and "unsloth_3b" in labels and "lora_ddp_eager" in labels and "full_ddp_fast" in labels
    # gpt-oss: the seed's phase-2 row (--speed off) first, then --speed auto without the seed's
    # explicit checkpointing and eager attention (they would win over the planner's choices)
    gpt = [line for line in p.stdout.splitlines() if "--arch gpt-oss-20b" in line]
    assert labels.index("gptoss_plain") < labels.index("gptoss_fast") and len(gpt) == 5
    assert "--speed off" in gpt[0] and "--gradient-checkpointing --attn eager" in gpt[0]
    assert all("--speed auto" in g and "--attn" not in g and "--gradient-checkpointing" not in g
               for g in gpt[1:4])
    assert "--attn flex_attention" in gpt[4]
    assert "-x compile=false" in gpt[2] and "--batch-size 2 --grad-accum 1" in gpt[3]
    # qlora: Axolotl's recipe and the TRL QLoRA mode on one model, shape and adapter
    q = {line.split()[1]: next_line for line, next_line in
         zip(p.stdout.splitlines(), p.stdout.splitlines()[1:]) if line.startswith("[qlora]")}
    assert list(q) == ["axolotl_qlora", "trl_qlora", "trl_qlora_liger", "trl_qlora_compiled"]
    shape = q["axolotl_qlora"].split("axolotl_qlora_ddp.py ")[1].split(" --results")[0]
    assert "--arch olmo-3-7b --full" in shape and "--lora-r 32" in shape
    assert "-x token_counter=batches" in shape and "--no-gradient-checkpointing" in shape
    assert f"trl_sft_lora_ddp.py {shape} --load-in-4bit -x save=false --results" in q["trl_qlora"]
    assert "--load-in-4bit -x save=false -x compile=true" in q["trl_qlora_compiled"]
    assert "--load-in-4bit -x save=false -x liger=true" in q["trl_qlora_liger"]
    # a window long enough that one stalled step cannot decide the ratio (2026-12-07: 10 steps,
    # 2 skipped, two stalls made TRL 0.87x Axolotl where its median step was 0.99x)
    assert "--max-steps 24" in shape and "--measure-after 6" in shape


@pytest.mark.unit
def test_ratios_and_loss_checks():
    def run(label, role, rate, loss=None):
        return {"label": label, "role": role, "rc": 0, "row": label,
                "result": {"steady_tokens_per_second": rate, "eval_loss_after": loss}}
    runs = [run("anchor_lora_1", "anchor_lora", 50_000), run("anchor_lora_2", "anchor_lora", 52_000),
            run("lora_ddp_fast", "fast", 61_200, 8.00), run("lora_ddp_plain", "plain", 30_000, 8.10),
            run("zero3_fast", "fast", 40_000, 7.70), run("zero3_plain", "plain", 16_000, 7.00),
            run("zero3_plain_accelerate", "accelerate", 20_000),
            run("zero3_fast_eager", "variant", 25_000),
            run("anchor_full_1", "anchor_full", 50_000),
            run("gptoss_plain", "plain", 3_312, 10.0), run("gptoss_fast", "fast", 6_624, 10.1)]
    r = llm_speed.ratios(runs)
    assert r["anchor_lora_tokens_per_second"] == 51_000
    assert r["lora_ddp_fast_vs_anchor_lora"] == 1.2
    assert r["zero3_fast_vs_accelerate_plain"] == 2.0 and r["zero3_fast_vs_anchor_full"] == 0.8
    assert r["zero3_fast_vs_eager"] == 1.6
    assert r["lora_fsdp_fast_vs_anchor_lora"] is None               # not run: no ratio
    checks = llm_speed.loss_checks(runs)
    assert checks["lora_ddp_fast"]["ok"] is True                     # 1.2% apart
    assert checks["zero3_fast"]["ok"] is False                       # 10% apart
    md = llm_speed.markdown({"when": "t", "machine": "m", "command": "c", "runs": runs,
                             "ratios": r, "loss_checks": checks})
    assert "| 61200 | 1.2 |" in md
    assert r["gptoss_fast_vs_plain"] == 2.0 and r["gptoss_fast_mb2_vs_plain"] is None
    qruns = [run("axolotl_qlora", "framework", 5_000), run("trl_qlora", "framework_twin", 6_000)]
    q = llm_speed.ratios(qruns)
    assert q["trl_qlora_vs_axolotl_qlora"] == 1.2 and q["trl_qlora_compiled_vs_axolotl_qlora"] is None
    assert "| 6000 | 1.2 |" in llm_speed.markdown({"when": "t", "machine": "m", "command": "c",
                                                   "runs": qruns, "ratios": q, "loss_checks": {}})
    assert checks["gptoss_fast"]["ok"] is True and "| 6624 | 2.0 |" in md   # vs the seed's
    assert "recompile limit" not in md                   # no compiled recipe run recorded any
    runs[2]["result"]["speed"] = {"recompile_limit_hits": {"value": ["wrapped_func"]}}
    md = llm_speed.markdown({"when": "t", "machine": "m", "command": "c", "runs": runs,
                             "ratios": r, "loss_checks": checks})
    assert '{"lora_ddp_fast": ["wrapped_func"]}' in md
    # no zero3_plain in the call: the seed's recipe under accelerate launch is the plain run;
    # bf16 master weights get their ratio to the full anchor and the same check
    zruns = [run("anchor_full_1", "anchor_full", 50_000),
             run("zero3_fast", "fast", 40_000, 7.33), run("zero3_fast_bf16", "variant", 44_000, 7.22),
             run("zero3_plain_accelerate", "accelerate", 20_000, 7.31)]
    z = llm_speed.ratios(zruns)
    assert z["zero3_fast_bf16_vs_anchor_full"] == 0.88 and z["zero3_fast_vs_accelerate_plain"] == 2.0
    zc = llm_speed.loss_checks(zruns)
    assert zc["zero3_fast"]["plain"] == zc["zero3_fast_bf16"]["plain"] == 7.31
    assert zc["zero3_fast"]["ok"] and zc["zero3_fast_bf16"]["ok"]


@pytest.mark.unit
def test_qlora_ratio_by_median_step_sees_through_two_stalled_steps():
    """The H100 rows of 2026-12-07 as recorded: TRL's steps 3 and 4 stalled (3.07 s, 4.26 s
    against 2.22-2.37 s after), so the mean rate says 0.87x Axolotl; per step TRL is as fast."""
    rec = json.loads((ROOT / "docs" / "results" /
                      "2026-12-07-h100-llm-speed-qlora-full.json").read_text())
    runs = [r for r in rec["runs"] if r["label"] in ("axolotl_qlora", "trl_qlora")]
    r = llm_speed.ratios(runs)
    assert r["trl_qlora_vs_axolotl_qlora"] == 0.866
    assert 0.97 <= r["trl_qlora_vs_axolotl_qlora_median_step"] <= 1.0
    trl = next(x["result"] for x in runs if x["label"] == "trl_qlora")
    steady = trl["step_times"][trl["warmup_steps_skipped"]:]
    assert sorted(steady)[-2:] == [3.0681, 4.2614]            # the two stalls
    assert r["trl_qlora_compiled_vs_axolotl_qlora_median_step"] is None   # not run


def test_table_group_is_the_issues_rows_in_order():
    p = _bench("--dry-run", "--group", "table")
    assert p.returncode == 0, p.stderr
    labels = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("[")]
    assert tuple(labels) == llm_speed.TABLE and len(labels) == 10
    # A B B A around each half, the quality twins after the LoRA half's second anchor
    assert labels[0] == "anchor_lora_1" and labels[3] == "anchor_lora_2"
    assert labels[6] == "anchor_full_1" and labels[-1] == "anchor_full_2"
    assert "--use_deepspeed" in p.stdout and "10 runs" in p.stdout


def test_a_run_whose_partners_were_all_skipped_is_skipped_too(tmp_path):
    # 2026-12-07 23:18: zero3_fast was skipped for the budget, and zero3_plain_accelerate, whose
    # only use is the ratio against it, then ran into a timeout in the seconds left
    p = _bench("--group", "full", "--only", "zero3_fast,zero3_plain_accelerate",
               "--budget-s", "1", "--out", str(tmp_path))
    assert "--- skipped zero3_fast: budget" in p.stdout, p.stdout + p.stderr
    assert "--- skipped zero3_plain_accelerate: zero3_fast did not run" in p.stdout
    # alone in the plan it has no partner to wait for: only the budget decides
    p = _bench("--group", "full", "--only", "zero3_plain_accelerate", "--budget-s", "1",
               "--out", str(tmp_path))
    assert "--- skipped zero3_plain_accelerate: budget" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_smoke_runs_one_anchor_row_through_its_cpu_mirror(tmp_path):
    p = _bench("--smoke", "--only", "anchor_lora_1", "--out", str(tmp_path), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "llm_speed.json").read_text())
    [row] = summary["runs"]
    assert row["rc"] == 0 and row["result"]["tok_s"] > 0 and row["result"]["smoke"] is True
    assert "(`anchor_lora_1`) |" in (tmp_path / "llm_speed.md").read_text()

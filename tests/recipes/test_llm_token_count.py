"""Tokens counted from the batches each step fetched (what the recipes fall back on when the
trainer's own counter sees nothing, as under Unsloth) equal TRL's own count, step by step, on a
real 2-rank CPU run of trl_sft_lora_ddp; the same run trains through the fused LoRA path."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import PY, ROOT, python_env

pytest.importorskip("trl")
pytest.importorskip("peft")


@pytest.mark.slow
def test_batch_token_count_equals_trls_and_lora_runs_fused(tmp_path):
    results = tmp_path / "r.json"
    env = python_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(tmp_path),
                      "HF_HOME": str(tmp_path / "hf"), "GPULAUNCH_FORCE_CPU": "1",
                      "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "recipes")])})
    env.pop("MLFLOW_TRACKING_URI", None)
    p = subprocess.run([PY, str(ROOT / "recipes" / "trl_sft_lora_ddp.py"), "--max-steps", "5",
                        "--eval-steps", "5", "--grad-accum", "2", "--report-to", "none",
                        "-x", "save=false", "-x", "token_counter=batches",
                        "--results", str(results)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads(results.read_text())
    assert r["world_size"] == 2 and r["token_counter"] == "batches"
    assert len(r["step_tokens"]) == 5 and all(n > 0 for n in r["step_tokens"])
    assert r["step_tokens"] == r["trainer_step_tokens"]          # both ranks, every step
    assert r["tokens"] == sum(r["step_tokens"])
    assert r["fused_lora"]["fused"] > 0 and r["speed"]["fuse_lora"]["value"] is True
    assert r["eval_loss_after"] < r["eval_loss_before"]

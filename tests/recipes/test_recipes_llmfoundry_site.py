"""LLM Foundry without an environment of its own: recipes/llmfoundry_fsdp.py run by this
interpreter (its torch, however new) with a ``--no-deps`` site tree of Foundry, composer and the
packages they import first on PYTHONPATH, the way the lent GPU runs it from
``.device-carry/llm-foundry.tar.xz``. ``bash bench/llm_foundry_bundle.sh --here`` builds the tree
for this interpreter (~145 MB, not part of CI's install); ``LLM_SITE_FOUNDRY`` names another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PY, ROOT

RECIPES = ROOT / "recipes"
pytestmark = pytest.mark.slow


def foundry_site() -> Path | None:
    """The site tree, if one was built for this Python (never built by CI)."""
    name = f"llmfoundry-py{sys.version_info[0]}.{sys.version_info[1]}"
    for where in (os.environ.get("LLM_SITE_FOUNDRY"),
                  Path.home() / ".cache" / "gpulaunch" / "sites" / name):
        if where and (Path(where) / "llmfoundry").is_dir():
            return Path(where)
    return None


def test_llmfoundry_on_this_torch_from_a_site_tree(tmp_path):
    """2 gloo ranks, FSDP2 through Composer, long chats, on this interpreter's torch; the
    numbers match the recipe's own torch-2.7 environment (same seed, same data)."""
    site = foundry_site()
    if site is None:
        pytest.skip("no LLM Foundry site tree for this Python (build it: "
                    "bash bench/llm_foundry_bundle.sh --here)")
    results = tmp_path / "r.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(tmp_path / "hf-home"),
           "TMPDIR": str(tmp_path),
           # the tree first: its transformers 4.51.3 / datasets 3.6 shadow the interpreter's
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src"), str(RECIPES)])}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([PY, str(RECIPES / "llmfoundry_fsdp.py"), "--results", str(results),
                           "--output", str(tmp_path / "out"), "--data", "long",
                           "--seq-len", "256", "--batch-size", "2", "--max-steps", "6",
                           "--eval-steps", "6", "--measure-after", "1", "--eval-batches", "1",
                           "-x", "global_batch=4", "-x", "peak_tflops=1", "--report-to", "none"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(results.read_text())
    assert r["framework"] == "llm-foundry 0.22.0, composer 0.32.1"
    assert r["technique"] == r["wrapper"] == "fsdp2" and r["world_size"] == 2
    assert r["steps"] == 6 and r["fill"] > 0.85 and r["mfu"] > 0
    before, after = r["eval_loss_before"], r["eval_loss_after"]
    assert after < before, r["eval_losses"]
    # 2026-12-07: 6.753 -> 6.002 here (torch 2.14.1), as in Foundry's own torch-2.7 environment
    assert abs(before - 6.753) < 0.02 and abs(after - 6.002) < 0.02, r["eval_losses"]
    check = r["export_check"]
    assert check["ok"] and check["max_abs_diff"] == 0.0 and check["tensors_compared"] > 0, check
    assert f"reloaded {tmp_path / 'out'}" in proc.stdout and "generated:" in proc.stdout


def test_llm_speed_foundry_group_smoke(tmp_path):
    """bench/llm_speed.py's foundry group on CPU: Foundry's row on its site tree
    (LLM_SITE_FOUNDRY, as bench/llm_speed.sh sets it on the GPU) beside the TRL full row, both
    counting the tokens of the fetched batches; at one rank Foundry drops its FSDP config."""
    site = foundry_site()
    if site is None:
        pytest.skip("no LLM Foundry site tree for this Python (build it: "
                    "bash bench/llm_foundry_bundle.sh --here)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "GPULAUNCH_FORCE_CPU": "1", "LLM_SITE_FOUNDRY": str(site)}
    proc = subprocess.run([PY, str(ROOT / "bench" / "llm_speed.py"), "--smoke", "--group",
                           "foundry", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "llm_speed.json").read_text())
    rows = {r["label"]: r["result"] for r in summary["runs"]}
    assert set(rows) == {"foundry_1b", "trl_full_1b"}
    assert rows["foundry_1b"]["framework"].startswith("llm-foundry 0.22.0")
    assert rows["foundry_1b"]["wrapper"] == "single"          # Foundry: no FSDP at 1 rank
    assert rows["trl_full_1b"]["token_counter"] == "batches"
    for r in rows.values():
        assert r["steps"] == 4 and all(t > 0 for t in r["step_tokens"])
    assert summary["ratios"]["trl_full_1b_vs_foundry_1b"] > 0
    assert summary["versions"]["foundry"]["llmfoundry"] == "0.22.0"

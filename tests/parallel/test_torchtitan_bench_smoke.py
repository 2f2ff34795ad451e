"""bench/torchtitan_gpu.py's dry run: both harnesses at tiny shapes, here, before a GPU call.

Our side trains for real (CPU, 3 steps); torchtitan's side, when torchtitan is importable, parses
its command line with torchtitan's own ConfigManager and builds its model of the same shape on
the meta device (torchtitan trains on CUDA only), whose parameter count must equal ours.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_runs_both_sides(tmp_path):
    sides = "titan,ours" if importlib.util.find_spec("torchtitan") else "ours"
    out = tmp_path / "titan.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "torchtitan_gpu.py"), "--dry-run", "--rounds", "1",
                           "--precisions", "bf16,fp8", "--sides", sides, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = {(r["side"], r["precision"]): r for r in data["runs"]}
    ours = runs[("ours", "bf16")]
    assert ours["tokens_per_s"] > 0 and ours["params_match_formula"] and ours["loss"] > 0
    assert "FP8 needs a GPU" in runs[("ours", "fp8")]["skipped"]
    assert data["summary"]["best"]["ours_bf16"]["tokens_per_s"] == ours["tokens_per_s"]
    if "titan" in sides:
        assert runs[("titan", "bf16")]["params_match_ours"] and runs[("titan", "bf16")]["ac"] == "selective"
        assert runs[("titan", "fp8")]["converters"] == ["quantize.linear.float8"]

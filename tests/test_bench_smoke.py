"""Each benchmark script runs end to end with a tiny setting and writes its report.

Benchmarks are never pass/fail on time: these tests check only that the scripts run, measure
something real (positive times, the launchers' ranks really ran) and write their files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
pytestmark = pytest.mark.slow


def _run(script: str, *args: str, out: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_launch_overhead_smoke(tmp_path):
    _run("launch_overhead.py", "--workers", "2", "--reps", "1", "--launchers",
         "api,api_warm,torchrun", out=tmp_path)
    data = json.loads((tmp_path / "launch_overhead.json").read_text())
    assert data["results"]["2"]["api_warm"][0]["phases"]["warm_start"] is True
    assert data["results"]["2"]["api"][0]["phases"]["warm_start"] is False
    for name in ("api", "api_warm", "torchrun"):
        (r,) = data["results"]["2"][name]
        assert "error" not in r, r
        # every rank stamped after its all_reduce, after the call and before it returned
        assert 0 < r["to_collective"] <= r["total"]
    phases = data["results"]["2"]["api"][0]["phases"]
    assert 0 < phases["agent_started"] <= phases["last_rank_started"] <= phases["returned"]
    assert "gpulaunch `.distributed()`" in (tmp_path / "launch_overhead.md").read_text()


def test_steady_state_smoke(tmp_path):
    _run("steady_state.py", "--reps", "1", "--steps", "3", "--warmup", "1", "--dim", "32",
         "--batch", "8", out=tmp_path)
    data = json.loads((tmp_path / "steady_state.json").read_text())
    for name in ("gpulaunch", "torchrun"):
        (run,) = data["runs"][name]
        assert [r["rank"] for r in run["ranks"]] == [0, 1]
        assert run["median_step_s"] > 0
        assert run["threads"] == [1]      # both launchers give each rank one thread
    assert data["meta"]["throughput_ratio_gpulaunch_over_torchrun"] > 0


def test_gpu_throughput_smoke(tmp_path):
    _run("gpu_throughput.py", "--smoke", "--models", "recipe", "--runs", "fsdp", out=tmp_path)
    data = json.loads((tmp_path / "gpu_throughput.json").read_text())
    assert [r["run"] for r in data["results"]] == ["fsdp"]
    for r in data["results"]:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and len(r["losses"]) == 3
    assert "| recipe | fsdp |" in (tmp_path / "gpu_throughput.md").read_text()


def test_scaling_smoke(tmp_path):
    _run("scaling_gpu.py", "--smoke", "--model", "recipe", "--strategies", "fsdp", "--gpus", "2",
         out=tmp_path)
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert [(r["strategy"], r["gpus"]) for r in data["results"]] == [("fsdp", 2)]
    for r in data["results"]:
        assert "error" not in r, r
        assert [x["rank"] for x in r["ranks"]] == list(range(r["gpus"]))


def test_launch_soak_smoke(tmp_path):
    _run("launch_soak.py", "--launches", "1", "--calls", "2", "--workers", "2", out=tmp_path)
    data = json.loads((tmp_path / "launch_soak.json").read_text())
    assert [r["state"] for r in data["results"]] == ["ok", "ok"]
    assert [r["warm"] for r in data["results"]] == [False, True]   # the 2nd via the standby
    assert "| cold | ok | 1 |" in (tmp_path / "launch_soak.md").read_text()

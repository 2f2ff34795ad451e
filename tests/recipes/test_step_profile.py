"""``-x profile=START:COUNT``: the recipes' step profiler (recipes/llm_common/step_profile.py).
Its trace arithmetic on hand-made traces, and one real recipe run on CPU that profiles two
steps and writes the report."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import PY, ROOT, python_env

sys.path.insert(0, str(ROOT / "recipes"))

from llm_common.step_profile import (  # noqa: E402
    busy_ms,
    idle_by_host_frame,
    parse_spec,
    sync_sources,
    trace_summary,
)


def X(name, ts, dur, cat, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}


# one 1 ms step: kernels at 100-300 and 500-900 us; the host in f(), then g() (which calls into
# torch and syncs) from 300 to 500 us
TRACE = {"traceEvents": [
    X("llm_common::step#3", 0, 1000, "user_annotation"),
    X("k1", 100, 200, "kernel", tid=7), X("k2", 500, 400, "kernel", tid=7),
    X("a.py(1): f", 0, 1000, "python_function"), X("b.py(2): g", 300, 200, "python_function"),
    X("torch/x.py(3): h", 320, 160, "python_function"),
    X("cudaStreamSynchronize", 400, 50, "cuda_runtime"), X("aten::item", 330, 5, "cpu_op")]}


@pytest.mark.unit
def test_spec_parsing_and_its_errors():
    assert parse_spec("12:3") == (12, 3)
    assert parse_spec("5") == (5, 3)
    for bad in ("x", "3:y", "-1:2", "2:0"):
        with pytest.raises(SystemExit, match="-x profile=12:3"):
            parse_spec(bad)


@pytest.mark.unit
def test_busy_time_merges_overlaps_and_clips_to_the_window():
    ev = [{"ts": 0, "dur": 100}, {"ts": 50, "dur": 100}, {"ts": 400, "dur": 200}]
    assert busy_ms(ev, 0, 1000) == pytest.approx(0.35)
    assert busy_ms(ev, 100, 500) == pytest.approx(0.15)


@pytest.mark.unit
def test_step_rows_syncs_and_what_the_host_ran_while_the_gpu_idled():
    (row,) = trace_summary(TRACE)
    assert row == {"step": "llm_common::step#3", "wall_ms": 1.0, "gpu_busy_ms": 0.6, "syncs": 1,
                   "sync_wait_ms": 0.05, "item_calls": 1}
    # both host waits happened in g (torch's own frames are skipped)
    assert sync_sources(TRACE) == [("b.py(2): g", 2)]
    idle = idle_by_host_frame(TRACE)
    # idle 0-100 and 900-1000 (in f), 300-500 (in g)
    assert idle["idle_ms_per_step"] == pytest.approx(0.4)
    assert dict(idle["by_frame_ms_per_step"]) == pytest.approx({"a.py(1): f": 0.2, "b.py(2): g": 0.2})


@pytest.mark.integration
@pytest.mark.slow
def test_a_recipe_profiles_the_steps_asked_for(tmp_path):
    """The full fine-tuning recipe as DDP on one CPU rank, steps 2 and 3 profiled with stacks."""
    prof = tmp_path / "prof"
    env = python_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(tmp_path / "hf"),
                      "GPULAUNCH_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path),
                      "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "recipes")])})
    cmd = [PY, str(ROOT / "recipes" / "trl_sft_full_zero3.py"), "--gpus", "1", "--max-steps", "5",
           "--eval-steps", "5", "-x", "technique=ddp", "-x", "save=false", "-x", "profile=2:2",
           "-x", "profile_stack=true", "-x", f"profile_dir={prof}",
           "--results", str(tmp_path / "r.json")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"[profile] steps 2..3 written to {prof}" in proc.stdout
    report = json.loads((prof / "steps.json").read_text())
    assert [r["step"] for r in report["steps"]] == ["llm_common::step#2", "llm_common::step#3"]
    assert all(r["wall_ms"] > 0 for r in report["steps"])
    assert report["idle"] is None                     # no GPU, no idle time to speak of
    md = (prof / "steps.md").read_text()
    assert "| llm_common::step#3 |" in md and "host CPU time" in md and "GPU time" not in md
    trace = json.loads(gzip.open(prof / "trace.json.gz").read())
    assert any(e.get("cat") == "python_function" for e in trace["traceEvents"])   # stacks asked for


@pytest.mark.integration
def test_bad_profile_and_master_values_fail_before_launching(tmp_path):
    env = python_env({"GPULAUNCH_HOME": str(tmp_path / "home"),
                      "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "recipes")])})
    script = str(ROOT / "recipes" / "trl_sft_full_zero3.py")
    for extra, message in ((["-x", "master=fp16"], "use fp32 (DeepSpeed's default) or bf16"),
                           (["-x", "master=bf16", "-x", "technique=ddp"], "is a ZeRO-3 setting"),
                           (["-x", "profile=late"], "use START:COUNT, e.g. -x profile=12:3"),
                           (["-x", "ds.timers.throughput.enabled=true", "-x", "technique=ddp"],
                            "for -x technique=zero3 only"),
                           (["-x", "ds.zero_optimization..x=1"], "the path after 'ds.'"),
                           *([(["-x", "ds.zero_optimization.overlap_com=false"],
                               "DeepSpeed refuses it: overlap_com: Extra inputs are not permitted")]
                             if importlib.util.find_spec("deepspeed") else [])):
        proc = subprocess.run([PY, script, *extra], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert "rank" not in proc.stderr.lower()      # no process was started
    # the FSDP2 recipe's one key of its own, checked before its GPU check and any launch
    proc = subprocess.run([PY, str(ROOT / "recipes" / "trl_sft_lora_fsdp.py"), "-x",
                           "reshard_after_forward=maybe"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "-x reshard_after_forward='maybe': use true or false" in proc.stderr, proc.stderr[-2000:]
    assert "rank" not in proc.stderr.lower() and "FSDPNeedsGPU" not in proc.stderr

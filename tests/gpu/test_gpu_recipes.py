"""Every recipe of recipes/ on the GPUs of this host, at its small (default) settings, run as a
user runs it (``python recipes/<name>.py ...``), each training to a lower loss.

The eight recipes start together, as eight caller processes, when the first of these tests
runs, and each test then waits for its own: on one H200 they are launch- and import-bound, so
running them side by side costs about as much as the slowest one instead of their sum. Each
gets two CPU threads, its own folders (data, checkpoints, HF cache, run directories) and
tracking off (test_gpu_tracking.py covers MLflow).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.recipe]
RECIPES = ROOT / "recipes"
DEADLINE_S = 330          # from the start of all eight to the end of the slowest
LLM_ARGS = ("--results", "{out}", "--output", "{work}/model", "--report-to", "none")


@dataclasses.dataclass(frozen=True)
class Recipe:
    args: tuple = ()
    needs: tuple = ()                 # (module, wheel) pairs that must be importable


SPECS = {
    "quickstart": Recipe(),
    "pytorch_mlp_ddp": Recipe(("--out", "{out}")),
    "pytorch_transformer_fsdp": Recipe(("--out", "{out}", "--ckpt-dir", "{work}/ckpt")),
    "pytorch_retinanet_ddp": Recipe(("--out", "{out}", "--data-root", "{work}/data"),
                                    (("torchvision", "torchvision"),
                                     ("pycocotools", "pycocotools"),
                                     ("torchmetrics", "torchmetrics"))),
    "lightning_two_tower_ddp": Recipe(("--out", "{out}", "--mlflow-uri", "", "--embeddings",
                                       "nn", "--ckpt-dir", "{work}/ckpt"),
                                      (("lightning", "lightning"),)),
    "trl_sft_lora_ddp": Recipe(LLM_ARGS, (("trl", "trl"), ("datasets", "datasets"),
                                          ("peft", "peft"))),
    "trl_sft_lora_fsdp": Recipe(LLM_ARGS, (("trl", "trl"), ("datasets", "datasets"),
                                           ("peft", "peft"))),
    "trl_sft_full_zero3": Recipe(LLM_ARGS, (("trl", "trl"), ("datasets", "datasets"),
                                            ("deepspeed", "deepspeed"))),
}


class Started:
    """One recipe's caller process, its folder and its output files."""

    def __init__(self, name: str, root: Path):
        self.name = name
        self.work = root / name
        self.work.mkdir(parents=True)
        self.out = self.work / "result.json"
        self.log = self.work / "output.log"
        fill = {"out": str(self.out), "work": str(self.work)}
        args = [a.format(**fill) for a in SPECS[name].args]
        paths = [str(ROOT / "src"), str(RECIPES)] + [
            p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "2",
               "GPULAUNCH_HOME": str(self.work / "gpulaunch-home"), "GPULAUNCH_QUIET": "",
               "GPULAUNCH_TRACKING": "0", "MLFLOW_DISABLE_TELEMETRY": "true",
               "HF_HOME": str(self.work / "hf-home"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "TMPDIR": str(self.work), "PYTHONUNBUFFERED": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch-extensions"))
        self.t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(RECIPES / f"{name}.py"), *args],
                                         cwd=self.work, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.seconds: float | None = None

    def wait(self, deadline: float) -> int:
        try:
            code = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self.name} still running after the recipes' {DEADLINE_S} s; "
                        f"last output:\n{self.tail()}", pytrace=False)
        if self.seconds is None:
            self.seconds = round(time.monotonic() - self.t0, 1)
        return code

    def stop(self) -> None:
        """Stop the recipe's own process group (its caller; gpulaunch then stops its ranks)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no output)"

    def result(self) -> dict:
        assert self.out.exists(), f"{self.name} wrote no result file; output:\n{self.tail()}"
        return json.loads(self.out.read_text())


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """All eight recipes, started at once; stopped (by their pids) if still running at the end."""
    root = tmp_path_factory.mktemp("recipes")
    runs = {name: Started(name, root) for name in SPECS}
    yield runs, time.monotonic() + DEADLINE_S
    for run in runs.values():
        run.stop()


def _finished(started, name: str, record, keep) -> Started:
    runs, deadline = started
    run = runs[name]
    keep(run.log)
    for module, wheel in SPECS[name].needs:
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"{module} is not importable on this GPU host: its wheel ({wheel}) was "
                        "not carried (scripts/gpu_wheels.sh builds .whl/)", pytrace=False)
    code = run.wait(deadline)
    record(recipe=name, seconds=run.seconds, exit_code=code)
    assert code == 0, f"{name} exited {code}; output:\n{run.tail()}"
    return run


@pytest.mark.timeout(DEADLINE_S + 30)
def test_quickstart(started, gpu, record, keep):
    text = _finished(started, "quickstart", record, keep).log.read_text()
    assert f"ranks: {list(range(gpu.count))}" in text, text[-3000:]
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", text)]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], losses
    record(losses=losses)


def _check_common(r: dict, gpu, name: str) -> None:
    assert r["device"] == "cuda" and r["world_size"] == gpu.count, (name, r["device"],
                                                                   r["world_size"])


@pytest.mark.timeout(DEADLINE_S + 30)
def test_pytorch_mlp_ddp(started, gpu, record, keep):
    r = _finished(started, "pytorch_mlp_ddp", record, keep).result()
    _check_common(r, gpu, "pytorch_mlp_ddp")
    record(before=r["before"], after=r["after"], samples_per_s=r["samples_per_s"])
    assert r["after"] < 0.7 * r["before"], (r["before"], r["after"])


@pytest.mark.timeout(DEADLINE_S + 30)
def test_pytorch_transformer_fsdp(started, gpu, record, keep):
    r = _finished(started, "pytorch_transformer_fsdp", record, keep).result()
    _check_common(r, gpu, "pytorch_transformer_fsdp")
    record(before=r["before"], after=r["after"], accuracy_after=r["accuracy_after"])
    assert r["strategy"] == "fsdp" and r["final_step"] == r["config"]["steps"]
    assert r["after"] < r["before"] - 0.5, (r["before"], r["after"])
    assert r["checkpoints"], "no checkpoint was written"


@pytest.mark.timeout(DEADLINE_S + 30)
def test_pytorch_retinanet_ddp(started, gpu, record, keep):
    r = _finished(started, "pytorch_retinanet_ddp", record, keep).result()
    _check_common(r, gpu, "pytorch_retinanet_ddp")
    record(loss_first=r["loss_first"], loss_last=r["loss_last"], map_after=r["after"])
    assert all(math.isfinite(v) for v in r["loss_history"])
    assert r["loss_last"] < 0.9 * r["loss_first"], (r["loss_first"], r["loss_last"])
    assert 0.0 <= r["before"] <= 1.0 and 0.0 <= r["after"] <= 1.0   # mAP computed


@pytest.mark.timeout(DEADLINE_S + 30)
def test_lightning_two_tower_ddp(started, gpu, record, keep):
    r = _finished(started, "lightning_two_tower_ddp", record, keep).result()
    _check_common(r, gpu, "lightning_two_tower_ddp")
    record(before=r["before"], after=r["after"], test_auroc=r["test_auroc"])
    assert r["cluster_environment"] == "TorchElasticEnvironment", r["cluster_environment"]
    assert r["after"] > r["before"] + 0.1 and r["after"] > 0.7, (r["before"], r["after"])


@pytest.mark.timeout(DEADLINE_S + 30)
@pytest.mark.parametrize("name,technique,wrapper", [
    ("trl_sft_lora_ddp", "ddp", "ddp"),
    ("trl_sft_lora_fsdp", "fsdp2", "fsdp2"),
    ("trl_sft_full_zero3", "zero3", "deepspeed")])
def test_trl_recipe(name, technique, wrapper, started, gpu, record, keep):
    run = _finished(started, name, record, keep)
    r = run.result()
    record(eval_losses=r["eval_losses"], technique=r["technique"], wrapper=r["wrapper"],
           peak_memory_gib=r["peak_memory_gib"])
    assert r["technique"] == technique and r["world_size"] == gpu.count, r
    assert r["precision"] == "bf16", r["precision"]
    if wrapper != "ddp" or gpu.count > 1:   # at world size 1 the HF Trainer wraps no DDP
        assert r["wrapper"] == wrapper, r["wrapper"]
    assert r["eval_loss_after"] < 0.9 * r["eval_loss_before"], r["eval_losses"]
    if name == "trl_sft_full_zero3":
        assert r["export_check"]["ok"] and r["export_check"]["max_abs_diff"] == 0.0, \
            r["export_check"]
    assert "generated:" in run.log.read_text(), "no reload + generation after training"

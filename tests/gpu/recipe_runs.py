"""The recipes of recipes/ as a user runs them (``python recipes/<name>.py ...``), eight caller
processes started together in the background (conftest's ``recipes_started``, when the
parallel-strategy test starts or the first recipe test, whichever comes first), each with two
CPU threads, its own folders (data, checkpoints, HF cache, run directories, TMPDIR) and tracking
off (test_gpu_tracking.py covers MLflow). On one H200 they are launch- and import-bound, so side
by side they cost about as much as the slowest one instead of their sum.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .helpers import ROOT

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
    # batch 4 and 3 epochs: on one GPU the CPU suite's global batch (and so its lr), more steps
    "pytorch_retinanet_ddp": Recipe(("--out", "{out}", "--data-root", "{work}/data",
                                     "--batch-size", "4", "--epochs", "3"),
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


def deadline() -> float:
    """time.monotonic() by which every recipe must be done: DEADLINE_S from now, or sooner
    if the suite's own cap (GPU_SUITE_DEADLINE, a Unix time set by gpu_suite.sh) comes first,
    so that a slow recipe fails with its output instead of the whole run being cut."""
    left = DEADLINE_S
    cap = os.environ.get("GPU_SUITE_DEADLINE")
    if cap:
        left = min(left, float(cap) - time.time() - 25)
    return time.monotonic() + max(30.0, left)


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
        for k in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "GPULAUNCH_FORCE_CPU"):
            env.pop(k, None)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(root / "torch-extensions"))
        self.t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, str(RECIPES / f"{name}.py"), *args],
                                         cwd=self.work, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.seconds: float | None = None

    def wait(self, until: float) -> int | None:
        """The exit code, or None if it was still running at ``until`` (then it is stopped)."""
        try:
            code = self.proc.wait(timeout=max(1.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            return None
        if self.seconds is None:
            self.seconds = round(time.monotonic() - self.t0, 1)
        return code

    def stop(self) -> None:
        """Stop the recipe's own process group (its caller; gpulaunch then stops its ranks)."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no output)"

    def result(self) -> dict:
        assert self.out.exists(), f"{self.name} wrote no result file; output:\n{self.tail()}"
        return json.loads(self.out.read_text())


class Runs:
    def __init__(self, root: Path):
        self.runs = {name: Started(name, root) for name in SPECS}
        self.deadline = deadline()

    def stop_all(self) -> None:
        for run in self.runs.values():
            run.stop()

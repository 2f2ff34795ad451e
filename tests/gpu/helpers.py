"""Caller-side helpers of the GPU suite: what the host has, what the GPUs hold, what a run left.

Everything here reads plain sources (``nvidia-smi``, NVML through torch, the run directory's
files) and never touches CUDA in this process: the test process is the caller of every launch,
and the suite checks that a caller never needs a CUDA context.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUT = os.environ.get("GPU_SUITE_OUT") or None     # set by scripts/gpu_suite.sh


# --------------------------------------------------------------------------- nvidia-smi
def _smi(query: str, fields: str) -> list[list[str]] | None:
    """Rows of ``nvidia-smi --query-<query>=<fields>``; None without a working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        p = subprocess.run([exe, f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
                           check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in p.stdout.splitlines() if line.strip()]


def gpu_rows() -> list[dict] | None:
    rows = _smi("gpu", "index,name,memory.total,memory.used,uuid,driver_version")
    if rows is None:
        return None
    return [{"index": int(r[0]), "name": r[1], "memory_total_mib": int(float(r[2])),
             "memory_used_mib": int(float(r[3])), "uuid": r[4], "driver": r[5]}
            for r in rows if len(r) >= 6]


def memory_used_mib() -> list[int]:
    """GPU memory in use now, per GPU, in MiB (every process of the host)."""
    return [g["memory_used_mib"] for g in gpu_rows() or []]


def compute_apps() -> dict[int, int]:
    """pid -> MiB of every process that holds a CUDA context now."""
    rows = _smi("compute-apps", "pid,used_memory") or []
    out = {}
    for r in rows:
        if r and r[0].isdigit():
            try:
                out[int(r[0])] = int(float(r[1]))
            except (IndexError, ValueError):   # "[N/A]" where the driver does not say
                out[int(r[0])] = -1
    return out


# --------------------------------------------------------------------------- the host
@functools.lru_cache(maxsize=1)
def host() -> dict:
    """What this host offers the suite: nvidia-smi's GPUs and what torch sees (via NVML:
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is set by conftest before torch is imported)."""
    info: dict = {"smi": gpu_rows(), "cuda": False, "count": 0, "torch": None, "error": None}
    try:
        import torch
        info["torch"] = torch.__version__
        info["cuda"] = bool(torch.cuda.is_available())
        info["count"] = torch.cuda.device_count() if info["cuda"] else 0
    except Exception as e:  # noqa: BLE001 - reported as the reason
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def gpu_type_name(device_name: str) -> str | None:
    """The gpulaunch GPUType name of an nvidia-smi device name ('NVIDIA H200' -> 'H200')."""
    from gpulaunch import GPUType
    found = [m.name for m in GPUType if re.search(rf"\b{m.name}\b", device_name, re.IGNORECASE)]
    return max(found, key=len) if found else None


# --------------------------------------------------------------------------- packages
def require(module: str, wheel: str | None = None, *, load: bool = True):
    """Import ``module`` or fail: on the GPU host a missing package is never a skip. It means
    its wheel was not carried (scripts/gpu_wheels.sh builds .whl/, the device call carries it).
    ``load=False`` only finds it, for packages the ranks use and this caller must not import
    (DeepSpeed probes the GPU when imported; this process must never touch CUDA)."""
    try:
        if not load:
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"No module named {module!r}")
            return None
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is the same finding
        pytest.fail(f"{module} is not importable on this GPU host ({type(e).__name__}: {e}). "
                    f"Its wheel ({wheel or module}) was not carried or did not install: build "
                    "the bundle with `bash scripts/gpu_wheels.sh` and name '.whl' in the device "
                    "call's carry; scripts/gpu_suite.sh installs it into /tmp/site.",
                    pytrace=False)


# --------------------------------------------------------------------------- run directories
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_pids(run_dir) -> set[int]:
    """Every pid a run recorded: its agent (status.json) and each rank of each attempt
    (attempt<k>/rank<r>.info.json), read as plain files."""
    run_dir = Path(run_dir)
    status = _read_json(run_dir / "status.json")
    pids = {int(p) for p in (status.get("pids") or {}).values()}
    if status.get("agent_pid"):
        pids.add(int(status["agent_pid"]))
    for info in run_dir.glob("attempt*/rank*.info.json"):
        pid = _read_json(info).get("pid")
        if pid:
            pids.add(int(pid))
    return pids


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gpu_released(run_dir, baseline_mib: list[int], *, timeout: float = 20.0,
                      slack_mib: int = 256) -> dict:
    """Wait until no process of the run is alive or holds a GPU context, and every GPU's memory
    is back within ``slack_mib`` of ``baseline_mib``; return what was seen (for the record).
    Fails the test, naming what is left, if that does not happen within ``timeout`` s."""
    pids = run_pids(run_dir)
    assert pids, f"the run at {run_dir} recorded no pids: nothing to check"
    deadline = time.monotonic() + timeout
    while True:
        apps = compute_apps()
        held = {p: mib for p, mib in apps.items() if p in pids}
        alive = sorted(p for p in pids if pid_alive(p))
        used = memory_used_mib()
        over = [(i, u, b) for i, (u, b) in enumerate(zip(used, baseline_mib)) if u > b + slack_mib]
        if not held and not alive and not over:
            return {"pids": sorted(pids), "memory_used_mib": used, "baseline_mib": baseline_mib}
        if time.monotonic() > deadline:
            pytest.fail(f"after the run ({run_dir}): processes alive {alive}, GPU contexts held "
                        f"by the run's pids {held}, GPUs over baseline (index, used, baseline "
                        f"MiB) {over}; all compute apps now: {apps}", pytrace=False)
        time.sleep(0.5)


def write_out(name: str, data) -> Path | None:
    """Write a JSON record into the suite's output folder ($GPU_SUITE_OUT), if there is one."""
    if not OUT:
        return None
    path = Path(OUT) / name
    path.write_text(json.dumps(data, indent=1, default=str))
    return path

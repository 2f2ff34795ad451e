"""What this host has: its GPUs (names, memory, catalog model) or none, without initialising CUDA.

The caller is often a notebook kernel. Initialising CUDA there would pin memory on GPU 0 and
make later forks unsafe, so we ask NVML (or ``nvidia-smi``) instead of ``torch.cuda``.
``CUDA_VISIBLE_DEVICES`` is honoured the way CUDA honours it (indices or UUIDs).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess

from . import nvml
from .catalog import GPUModel, GPUType, gpu_type_from_device_name, model_for


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    index: int               # index as seen by CUDA in this process (after CUDA_VISIBLE_DEVICES)
    name: str                # e.g. "NVIDIA H200"
    memory_bytes: int
    uuid: str = ""

    @property
    def gpu_type(self) -> GPUType | None:
        return gpu_type_from_device_name(self.name)

    @property
    def model(self) -> GPUModel | None:
        """This GPU's catalog entry with its real memory (None for a model we do not know)."""
        try:
            return model_for(self.name).with_memory(self.memory_bytes)
        except ValueError:
            return None


@dataclasses.dataclass(frozen=True)
class HostInfo:
    gpus: tuple[GPUInfo, ...]
    cpu_count: int
    source: str              # how the GPUs were found: "nvml", "nvidia-smi", "none", "forced-cpu"

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU ({self.cpu_count} CPU cores)"
        names: dict[str, int] = {}
        for g in self.gpus:
            names[g.name] = names.get(g.name, 0) + 1
        return ", ".join(f"{n} x {name} ({self.gpus[0].memory_bytes / 2**30:.0f} GiB)"
                         for name, n in names.items())


def _from_nvml() -> list[GPUInfo] | None:
    found = nvml.devices()
    if found is None:
        return None
    return [GPUInfo(d.index, d.name, d.memory_bytes, d.uuid) for d in found]


def _from_nvidia_smi() -> list[GPUInfo] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=index,name,memory.total,uuid",
                               "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return []
    out = []
    for line in proc.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            out.append(GPUInfo(int(parts[0]), parts[1], int(float(parts[2])) * 2**20, parts[3]))
    return out


def _apply_visible_devices(gpus: list[GPUInfo]) -> list[GPUInfo]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    chosen: list[GPUInfo] = []
    for token in [t.strip() for t in visible.split(",") if t.strip()]:
        match = None
        if token.lstrip("-").isdigit():
            idx = int(token)
            if idx < 0:
                break  # CUDA stops at the first invalid index
            match = next((g for g in gpus if g.index == idx), None)
        else:
            match = next((g for g in gpus if g.uuid and g.uuid.startswith(token)), None)
        if match is None:
            break
        chosen.append(match)
    return [dataclasses.replace(g, index=i) for i, g in enumerate(chosen)]


@functools.lru_cache(maxsize=1)
def _physical_gpus() -> tuple[tuple[GPUInfo, ...], str]:
    for source, probe in (("nvml", _from_nvml), ("nvidia-smi", _from_nvidia_smi)):
        found = probe()
        if found is not None:
            return tuple(found), source
    return (), "none"


def detect() -> HostInfo:
    """Describe this host. ``GPULAUNCH_FORCE_CPU=1`` pretends there is no GPU (CPU workers)."""
    cpus = os.cpu_count() or 1
    if os.environ.get("GPULAUNCH_FORCE_CPU", "").lower() in ("1", "true", "yes"):
        return HostInfo((), cpus, "forced-cpu")
    gpus, source = _physical_gpus()
    return HostInfo(tuple(_apply_visible_devices(list(gpus))), cpus, source if gpus else "none")


def max_cpu_workers(cpu_count: int) -> int:
    """How many CPU worker processes we allow on a GPU-less host.

    Oversubscription is fine for testing collectives (CI runs 4 ranks on 2 cores), but far more
    processes than cores only makes everything crawl; beyond this limit asking is a mistake.
    """
    override = os.environ.get("GPULAUNCH_MAX_CPU_WORKERS")
    if override:
        return int(override)
    return max(8, 2 * cpu_count)

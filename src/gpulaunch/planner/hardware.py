"""GPU specs and detection.

Memory totals are what ``nvidia-smi --query-gpu=memory.total`` reports (MiB), not the marketing GB,
so a plan made with ``--gpu H100`` agrees with one made on the machine. Throughput is the dense
bf16 tensor-core datasheet number; bandwidths are the achievable NCCL bus bandwidth per GPU, roughly
80% of the link's unidirectional rate. These are for *relative* step times; absolute times are
rough by design.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16_tflops: float          # dense, datasheet
    intra_node_gbps: float      # GB/s per GPU, NCCL bus bandwidth inside a node
    inter_node_gbps: float      # GB/s per GPU across nodes (typical fabric for this GPU class)
    host_link_gbps: float = 25.0  # GB/s host<->device (PCIe Gen4/5 x16 achievable), for CPU offload


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("H100", 81559 * MiB, 989.0, 360.0, 45.0, 50.0),
        GpuSpec("H200", 143771 * MiB, 989.0, 360.0, 45.0, 50.0),
        GpuSpec("B200", 183359 * MiB, 2250.0, 720.0, 45.0, 50.0),
        GpuSpec("A100-80GB", 81920 * MiB, 312.0, 240.0, 22.0, 25.0),
        GpuSpec("A100-40GB", 40960 * MiB, 312.0, 240.0, 22.0, 25.0),
        GpuSpec("L40S", 46068 * MiB, 362.0, 20.0, 10.0, 25.0),
        GpuSpec("A10", 23028 * MiB, 125.0, 20.0, 3.0, 25.0),
        GpuSpec("A10G", 23028 * MiB, 70.0, 20.0, 3.0, 25.0),
        GpuSpec("L4", 23034 * MiB, 121.0, 20.0, 3.0, 25.0),
        GpuSpec("RTX4090", 24564 * MiB, 165.0, 20.0, 3.0, 25.0),
        GpuSpec("T4", 15360 * MiB, 65.0, 10.0, 3.0, 12.0),  # no bf16: fp16 number
    ]
}


def gpu_spec(name: str) -> GpuSpec:
    """Find a spec by a user's spelling or a driver's device name ("NVIDIA H100 80GB HBM3")."""
    key = name.upper().replace("NVIDIA", "").replace(" ", "").replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    # Device names: match the longest table key contained in the name, then disambiguate A100s.
    if "A100" in key:
        return GPUS["A100-40GB" if "40GB" in key or "40G" in key else "A100-80GB"]
    for k in sorted(GPUS, key=len, reverse=True):
        if k.replace("-", "") in key.replace("-", ""):
            return GPUS[k]
    raise ValueError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)} or pass gpu_memory_bytes=")


@dataclass(frozen=True)
class Detected:
    name: str
    memory_bytes: int
    count: int


def detect() -> Detected | None:
    """GPUs on this host via NVML, then nvidia-smi; None when neither finds one."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            if n:
                h = pynvml.nvmlDeviceGetHandleByIndex(0)
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else name
                return Detected(name, int(pynvml.nvmlDeviceGetMemoryInfo(h).total), n)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no GPU: all mean "ask nvidia-smi"
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            rows = [r.rsplit(",", 1) for r in out.strip().splitlines() if r.strip()]
            if rows:
                return Detected(rows[0][0].strip(), int(float(rows[0][1])) * MiB, len(rows))
        except (subprocess.SubprocessError, ValueError, IndexError, OSError):
            pass
    return None

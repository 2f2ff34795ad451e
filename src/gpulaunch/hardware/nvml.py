"""The one NVML probe: which GPUs this host has and what each is doing, without CUDA.

Used by host detection (``host.detect``) and by the per-node system-metrics sampler. NVML
(``nvidia-ml-py``) never creates a CUDA context, so a notebook kernel that asks stays free of
GPU memory. Without the library, or without a driver, the answers say so instead of raising:
``devices()`` is None (no library) or [] (no driver / no GPU).
"""

from __future__ import annotations

import dataclasses
import threading

_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Device:
    index: int               # NVML (physical) index
    name: str                # e.g. "NVIDIA H200"
    uuid: str
    memory_bytes: int


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Session:
    """``with Session() as nv:`` -> ``nv`` is the pynvml module, initialised (None without a
    library or driver, with ``error`` saying why). Nested sessions are fine (NVML counts)."""

    def __init__(self):
        self.nv = None
        self.error: str | None = None

    def __enter__(self):
        try:
            import pynvml
        except ImportError:
            self.error = "nvidia-ml-py is not installed"
            return None
        try:
            with _lock:
                pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded
            self.error = f"{type(e).__name__}: {e}"
            return None
        self.nv = pynvml
        return pynvml

    def __exit__(self, *exc):
        if self.nv is not None:
            try:
                with _lock:
                    self.nv.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
        return False


def devices() -> list[Device] | None:
    """Every GPU NVML sees (None: no NVML library here; []: no driver or no GPU)."""
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return None
    with Session() as nv:
        if nv is None:
            return []
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            out.append(Device(i, _text(nv.nvmlDeviceGetName(h)),
                              _text(nv.nvmlDeviceGetUUID(h)),
                              int(nv.nvmlDeviceGetMemoryInfo(h).total)))
        return out


def handle_for(nv, ident: str):
    """An NVML handle from a CUDA_VISIBLE_DEVICES entry (an index or a UUID prefix)."""
    if ident.isdigit():
        return nv.nvmlDeviceGetHandleByIndex(int(ident))
    return nv.nvmlDeviceGetHandleByUUID(ident)


def readings(nv, handle) -> dict[str, float]:
    """What one GPU is doing now, under MLflow's metric names; a counter the GPU lacks is
    left out."""
    out: dict[str, float] = {}
    probes = (
        ("utilization_percentage", lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu),
        ("memory_usage_megabytes", lambda: nv.nvmlDeviceGetMemoryInfo(handle).used / 1e6),
        ("memory_usage_percentage", lambda: (lambda mi: mi.used / mi.total * 100)(
            nv.nvmlDeviceGetMemoryInfo(handle))),
        ("power_usage_watts", lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000),
        ("power_usage_percentage", lambda: nv.nvmlDeviceGetPowerUsage(handle)
         / nv.nvmlDeviceGetEnforcedPowerLimit(handle) * 100),
        ("temperature_celsius", lambda: nv.nvmlDeviceGetTemperature(handle, 0)),
    )
    for name, read in probes:
        try:
            out[name] = float(read())
        except Exception:  # noqa: BLE001
            pass
    return out


def process_memory() -> dict[int, int]:
    """Bytes of GPU memory each process holds, over every GPU (pid -> bytes), as NVML sees
    it; {} without NVML or a driver. In a container NVML may report the host's pids, and then
    nothing here matches a local pid: callers say "unknown", not 0."""
    out: dict[int, int] = {}
    with Session() as nv:
        if nv is None:
            return out
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(i))
            except Exception:  # noqa: BLE001 - not supported on this GPU / driver
                continue
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)
                if isinstance(used, int):
                    out[proc.pid] = out.get(proc.pid, 0) + used
    return out

"""What each rank's GPU is doing, for the panel: NVML readings (no CUDA context in the kernel).

A rank with local rank ``i`` uses the ``i``-th entry of the ``CUDA_VISIBLE_DEVICES`` it was
given (the run's ``env=``, else the caller's), or GPU ``i`` when none is set. Only GPUs of this
host are read: ranks on other nodes show none.
"""

from __future__ import annotations

import os

from ..hardware import nvml


def visible_ids(spec) -> list[str]:
    env = dict(spec.env).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if env is None or not env.strip():
        return [str(i) for i in range(spec.nproc_per_node)]
    return [x.strip() for x in env.split(",") if x.strip()]


def read(spec) -> dict[int, dict[str, float]]:
    """local rank -> NVML readings (empty without NVML or for a CPU run)."""
    if spec.device != "cuda":
        return {}
    out = {}
    with nvml.Session() as nv:
        if nv is None:
            return {}
        for local, ident in enumerate(visible_ids(spec)[:spec.nproc_per_node]):
            try:
                out[local] = nvml.readings(nv, nvml.handle_for(nv, ident))
            except Exception:  # noqa: BLE001 - a GPU that cannot be read shows nothing
                continue
    return out

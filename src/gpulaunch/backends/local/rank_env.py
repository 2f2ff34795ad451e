"""The environment of a rank, one definition for every way a rank is started: a cold rank
(the node agent, ``agent.py``, on top of what torchelastic sets per rank) and a warm one
(``pool_ranks.py`` at the pool's start, ``pool.py`` for each call). Torch-free, so the caller
can import it.

    rank_env(env, spec, run_dir=..., node_rank=..., nnodes=...)   what gpulaunch adds
    torchrun_env(rank, world, port)                                torchrun's own variables
"""

from __future__ import annotations

import os

NCCL_TRACE_PREFIX = "nccl_trace_rank_"     # TORCH_NCCL_DEBUG_INFO_TEMP_FILE, in the run dir


def rank_env(env: dict[str, str], spec, *, run_dir=None, node_rank: int = 0,
             nnodes: int = 1) -> dict[str, str]:
    """``env`` with what every rank of ``spec`` gets from gpulaunch (changed in place and
    returned). ``run_dir`` None: not known yet (a pool that starts before its first call)."""
    env["NODE_RANK"] = str(node_rank)          # Composer, Lightning and others read it
    env.setdefault("REPLICA_RANK", "0")
    env["PYTHONUNBUFFERED"] = "1"
    env["GPULAUNCH_DEVICE"] = spec.device
    # the launch's rank-side settings, from the spec only (one route: options -> spec -> here)
    env.pop("GPULAUNCH_HANG_TIMEOUT", None)
    env.pop("GPULAUNCH_DEBUG", None)
    if spec.hang_timeout:
        env["GPULAUNCH_HANG_TIMEOUT"] = str(float(spec.hang_timeout))
    if spec.debug:
        env["GPULAUNCH_DEBUG"] = "1"
    if run_dir is not None:
        env["GPULAUNCH_RUN_DIR"] = str(run_dir)
    if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"              # what torchrun does; avoids oversubscription
    if nnodes == 1:
        # Single host: collectives' sockets on loopback too (nothing listens publicly).
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if spec.device == "cuda":
            env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if spec.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""          # CPU workers: never touch a GPU by accident
    else:
        # NCCL flight recorder: a record of the last collectives, dumped on a watchdog timeout
        # (and by our hang routine, into attempt<k>/rank<r>.nccl_trace.pkl).
        env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")   # older torch's name
        env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if run_dir is not None:
            env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                           os.path.join(str(run_dir), NCCL_TRACE_PREFIX))
    return env


def torchrun_env(rank: int, world_size: int, port: int, *, attempt: int = 0) -> dict[str, str]:
    """What torchrun sets for a rank of a one-host job (a pool rank: no torchelastic)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(attempt)}

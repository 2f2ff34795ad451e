"""What code inside a rank asks: who am I, how many are we, and a ready process group.

    from gpulaunch import runtime as rt
    device = rt.init()              # nccl on GPUs (device bound) or gloo on CPU; returns device
    rt.print0("only rank 0 prints this")

Values come from ``torch.distributed`` once it is initialised, else from the torchrun
environment (RANK, LOCAL_RANK, ...). If both exist and disagree, that is a launcher bug or a
misconfigured environment, and we say so rather than guess. Outside any launcher the helpers
describe a world of one, and ``init()`` creates a one-rank group, so the same function can be
debugged with ``train.func(...)``.
"""

from __future__ import annotations

import datetime
import os
import socket

from .common import private
from .common.constants import PG_TIMEOUT_S as DEFAULT_PG_TIMEOUT_S
from .errors import ConfigurationError
from .rank.state import RANK_STATE, RankState
from .rank.watchdog import heartbeat

__all__ = ["get_global_rank", "get_local_rank", "get_world_size", "get_local_world_size",
           "get_node_rank", "get_replica_rank", "get_restart_count", "get_run_dir", "is_main",
           "print0", "device", "init", "barrier", "shutdown", "heartbeat", "state",
           "preemption"]

# Per-rank state that persists across the calls of one warm pool (keep_alive=): see
# rank/state.py (the pool's rank process holds the same object).
state: RankState = RANK_STATE


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _checked(env_name: str, default: int, from_dist: str, group) -> int:
    """The value from torch.distributed when a group exists, else the launcher's environment;
    if both exist and disagree, the environment and the process group contradict each other."""
    dist = _dist()
    env_value = _env_int(env_name, default)
    if dist is None:
        return env_value
    value = getattr(dist, from_dist)(group)
    if group is None and env_name in os.environ and value != env_value:
        raise ConfigurationError(f"torch.distributed.{from_dist}() says {value} but "
                                 f"{env_name}={env_value}: the process group was initialised with "
                                 "settings that contradict the launcher's environment.")
    return value


def get_global_rank(group=None) -> int:
    return _checked("RANK", 0, "get_rank", group)


def get_world_size(group=None) -> int:
    return _checked("WORLD_SIZE", 1, "get_world_size", group)


def get_local_rank() -> int:
    return _env_int("LOCAL_RANK", 0)


def get_local_world_size() -> int:
    return _env_int("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    return _env_int("NODE_RANK", _env_int("GROUP_RANK", 0))


def get_replica_rank() -> int:
    return _env_int("REPLICA_RANK", 0)


def get_restart_count() -> int:
    """0 on the first attempt, then 1, 2, ... after each whole-group restart (max_restarts)."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def get_run_dir() -> str | None:
    return os.environ.get("GPULAUNCH_RUN_DIR")


def preemption():
    """The preemption notice of this run (``PreemptionNotice``: ``deadline``, ``remaining()``,
    ``source``, ``restart``), or None. Cheap enough to call every step (one ``os.stat``); the
    ranks may see it one step apart, so act on it through ``parallel.save_on_preemption``,
    which makes every rank agree (docs/fault-tolerance.md, "Preemption")."""
    from .common.preemption import RANK_VIEW
    return RANK_VIEW.current()


def is_main() -> bool:
    return get_global_rank() == 0


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device():
    """This rank's device: ``cuda:<local_rank>`` on a GPU rank, else ``cpu``."""
    import torch
    if _wants_cuda():
        return torch.device("cuda", get_local_rank())
    return torch.device("cpu")


def _wants_cuda() -> bool:
    if os.environ.get("GPULAUNCH_DEVICE") == "cpu":
        return False
    import torch
    return torch.cuda.is_available() and get_local_rank() < torch.cuda.device_count()


def init(backend: str | None = None, timeout: float | None = None):
    """Create the default process group (once) and bind this rank's device; return the device.

    backend: "nccl" on GPU ranks, "gloo" on CPU ranks by default; any torch backend string
        (e.g. "cpu:gloo,cuda:nccl") is accepted.
    timeout: collective timeout in seconds (default 30 minutes).
    """
    import torch
    import torch.distributed as dist

    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    if "RANK" not in os.environ:  # not launched: a world of one, for debugging with .func()
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_loopback_port()))
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    seconds = timeout if timeout is not None else float(
        os.environ.get("GPULAUNCH_PG_TIMEOUT", DEFAULT_PG_TIMEOUT_S))
    kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=seconds)}
    if dev.type == "cuda":
        kwargs["device_id"] = dev   # eager NCCL init, bound to this GPU
    dist.init_process_group(**kwargs)
    return dev


def barrier() -> None:
    """A barrier across all ranks (no-op when no process group exists)."""
    dist = _dist()
    if dist is None:
        return
    if dist.get_backend() == "nccl":
        import torch
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group if one exists (the worker also does this on exit)."""
    dist = _dist()
    if dist is not None:
        dist.destroy_process_group()


def report(step: int | None = None, **metrics) -> None:
    """Record metrics of this rank (``rt.report(step=i, loss=loss)``): the notebook panel
    shows the latest value of each and plots rank 0's. Values are numbers (a one-element tensor
    is read with ``.item()``). Appended as one JSON line to ``rank<r>.metrics.jsonl`` in the run
    directory; outside a gpulaunch run it does nothing, so the function still runs on its own."""
    run_dir = get_run_dir()
    if not run_dir or not metrics:
        return
    import json
    import time
    rec = {"t": round(time.time(), 3)}
    if step is not None:
        rec["step"] = int(step)
    for name, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigurationError(f"rt.report({name}=...): got a {type(value).__name__}; "
                                     "report numbers (or one-element tensors)")
        rec[name] = value
    path = os.path.join(run_dir, f"attempt{get_restart_count()}",
                        f"rank{get_global_rank()}.metrics.jsonl")
    # one write per line: a reader never sees half a record; owner-only, as the run dir
    with private.open_file(path, "a") as f:
        f.write(json.dumps(rec) + "\n")

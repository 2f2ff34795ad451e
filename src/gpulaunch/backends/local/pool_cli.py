"""``gpulaunch pool``: list the warm pools (``keep_alive=``) on this host, or close them.

A pool belongs to the process that made it (a notebook kernel); this command only reads the
``pool.json`` records and ends ranks. The owner notices at its next call and starts cold,
saying that the ranks had exited.
"""

from __future__ import annotations

import os
import time

from .pool_ranks import close_recorded, live_pools


def add_parser(sub) -> None:
    p = sub.add_parser("pool", help="list or close warm rank pools (keep_alive=)")
    p.add_argument("action", nargs="?", choices=("list", "close"), default="list")
    p.add_argument("pool_id", nargs="?", help="close: this pool only (default: every pool)")


def _age(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def describe(p: dict, gpu_memory: dict[int, int], now: float) -> str:
    """One line for a live pool: who owns it, how old and idle, what GPU memory it holds."""
    owner = p.get("caller_pid")
    owner_alive = owner is not None and os.path.exists(f"/proc/{owner}")
    line = (f"{p['pool_id']}  {p['world_size']} x {p.get('gpu_type') or p['device']}  "
            f"ranks {','.join(map(str, p['alive']))}  caller {owner}"
            f"{'' if owner_alive else ' (gone)'}  age {_age(now - p['started'])}  "
            f"idle {_age(now - p['last_used'])}  calls {p.get('calls', 0)}")
    if p["device"] != "cpu":
        held = [gpu_memory[pid] for pid in p["alive"] if pid in gpu_memory]
        line += (f"  GPU memory {sum(held) / 2**30:.2f} GiB" if held
                 else "  GPU memory unknown (NVML shows none of its pids)")
    return line


def lines() -> list[str]:
    """The live pools of this host, a line each (``gpulaunch pool list``, ``gpulaunch doctor``)."""
    pools = live_pools()
    if not pools:
        return []
    memory = {}
    if any(p["device"] != "cpu" for p in pools):
        from ...hardware import nvml
        memory = nvml.process_memory()
    now = time.time()
    return [describe(p, memory, now) for p in pools]


def main(args) -> int:
    if args.action == "list":
        found = lines()
        print("\n".join(found) if found else "no warm pool on this host")
        return 0
    pools = live_pools()
    chosen = [p for p in pools if args.pool_id in (None, p["pool_id"])]
    if args.pool_id and not chosen:
        print(f"gpulaunch: no live pool {args.pool_id!r} (see `gpulaunch pool list`)")
        return 1
    for p in chosen:
        close_recorded(p)
        print(f"closed pool {p['pool_id']} (ranks {','.join(map(str, p['alive']))})")
    return 0

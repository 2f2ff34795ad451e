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


def main(args) -> int:
    pools = live_pools()
    if args.action == "list":
        if not pools:
            print("no warm pool on this host")
        now = time.time()
        for p in pools:
            owner = p.get("caller_pid")
            owner_alive = owner is not None and os.path.exists(f"/proc/{owner}")
            print(f"{p['pool_id']}  {p['world_size']} x {p.get('gpu_type') or p['device']}  "
                  f"ranks {','.join(map(str, p['alive']))}  caller {owner}"
                  f"{'' if owner_alive else ' (gone)'}  age {_age(now - p['started'])}  "
                  f"idle {_age(now - p['last_used'])}  calls {p.get('calls', 0)}")
        return 0
    chosen = [p for p in pools if args.pool_id in (None, p["pool_id"])]
    if args.pool_id and not chosen:
        print(f"gpulaunch: no live pool {args.pool_id!r} (see `gpulaunch pool list`)")
        return 1
    for p in chosen:
        close_recorded(p)
        print(f"closed pool {p['pool_id']} (ranks {','.join(map(str, p['alive']))})")
    return 0

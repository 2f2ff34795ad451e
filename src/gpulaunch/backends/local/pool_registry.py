"""This caller's warm pool (at most one), handed to one call at a time (``pool.py`` runs the
calls): which pool a call gets (the same one while its ``PoolKey`` matches and its ranks live,
else a new one, saying why in one line), its idle timer (``keep_alive`` seconds), and what a
pool that ended leaves to the next one: the ``rt.state`` keys its ranks held and why they are
gone (``dropped``), so that the new ranks can name the call to re-run."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from ...common import procutil
from ...errors import ConfigurationError
from .pool_ranks import PoolKey, RankPool, changed_file


def _say(line: str) -> None:
    if not os.environ.get("GPULAUNCH_QUIET"):
        sys.stdout.write(f"gpulaunch: pool: {line}\n")
        sys.stdout.flush()


class PoolRegistry:
    """This caller's pool (at most one), handed to one call at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self.pool: RankPool | None = None
        self.last_end: str | None = None
        self.dropped: dict | None = None     # {"keys": {key: call}, "why"}: a pool that ended
        self._timer: threading.Timer | None = None

    def _ended(self, pool: RankPool, why: str) -> None:
        """``pool`` is gone: the next pool's ranks learn which rt.state keys went with it."""
        if pool.state_owners:
            self.dropped = {"keys": dict(pool.state_owners), "why": why}

    def acquire(self, spec, env: dict[str, str]) -> tuple[RankPool, bool]:
        """The pool for this call and whether it is warm; a new one when needed (saying why)."""
        key = PoolKey.of(spec, env)
        with self._lock:
            self._cancel_timer()
            pool, self.pool = self.pool, None
            if pool is not None and getattr(pool, "busy", False):
                self.pool = pool
                raise ConfigurationError(
                    "the warm pool (keep_alive=) is running another call of this process; wait "
                    "for it (handle.result()) or launch this one with keep_alive=False.")
            if pool is not None:
                exited = pool.exited()
                if pool.closed is not None:
                    self.last_end = pool.closed
                elif pool.record_removed():
                    pool.close("closed by `gpulaunch pool close`")
                    self.last_end = "it was closed by `gpulaunch pool close`"
                elif exited:
                    why = "; ".join(f"rank {r} {procutil.describe_exit(c)}"
                                    for r, c in sorted(exited.items()))
                    pool.close(why)
                    self.last_end = f"{why} while it was idle"
                elif changed_file(pool.user_files):
                    why = f"{changed_file(pool.user_files)} changed since the pool started"
                    pool.close(why)
                    self.last_end = why
                elif not key.differs(pool.key):
                    self.pool = pool
                    return pool, True
                else:
                    _say(f"the settings changed ({key.differs(pool.key)}): closing warm pool "
                         f"{pool.pool_id} and starting a new one (cold)")
                    pool.close("settings changed")
                    self.last_end = None
            if pool is not None:
                self._ended(pool, self.last_end or "its settings changed")
            if self.last_end:
                _say(f"starting a new pool (cold): the previous one ended: {self.last_end}"
                     f"{dropped_note(self.dropped)}")
                self.last_end = None
            pool = RankPool(key, spec, env).start()
            pool.dropped, self.dropped = self.dropped, None
            self.pool = pool
            return pool, False

    def teardown(self, pool: RankPool, why: str, grace: float = 0.0) -> None:
        pool.close(why, grace)
        with self._lock:
            self._ended(pool, why)
            if self.pool is pool:
                self.pool = None
                self.last_end = why

    def release(self, pool: RankPool, idle_s: float) -> None:
        """The call is over and the pool usable: wait for the next call, at most ``idle_s``."""
        with self._lock:
            pool.busy = False
            pool.last_used = time.time()
            pool.write_record()
            self._cancel_timer()
            self._timer = threading.Timer(idle_s, self._expire, args=(pool, idle_s))
            self._timer.daemon = True
            self._timer.start()

    def _expire(self, pool: RankPool, idle_s: float) -> None:
        with self._lock:
            if self.pool is not pool or getattr(pool, "busy", False):
                return
            self.pool = None
            self.last_end = f"it was idle for {idle_s:g} s (keep_alive)"
            self._ended(pool, self.last_end)
        pool.close(self.last_end)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self, why: str = "closed") -> RankPool | None:
        """Close this caller's pool now (between calls or during one: its ranks end)."""
        with self._lock:
            self._cancel_timer()
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.close(why)
        return pool


def dropped_note(dropped: dict | None) -> str:
    if not dropped or not dropped.get("keys"):
        return ""
    return f"; its rt.state was dropped ({', '.join(sorted(dropped['keys']))})"


POOLS = PoolRegistry()
atexit.register(POOLS.close, "the caller exited")

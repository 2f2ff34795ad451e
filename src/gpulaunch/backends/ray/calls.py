"""Ray calls for following a job that never open a Ray connection of their own.

Every public Ray call (``ray.get``, ``ray.wait``, ``ray.kill``, ``actor.method.remote(...)``)
first runs ``ray.init()`` when this process has no connection: Ray's "auto-init". For the
thread that follows a job that is wrong. When the user calls ``ray.shutdown()`` mid-run, that
thread is often inside a call, or between checking ``ray.is_initialized()`` and making the next
one; auto-init then silently connects again (to a cluster that may be gone, or starts a new
local one) to poll actors that died with the old connection, and leaves the user connected.

Ray has no per-call switch for this (``RAY_ENABLE_AUTO_CONNECT=0`` is read once, for the whole
process, and would change the user's own calls), so these call the functions that the public
ones wrap (``functools.wraps`` keeps them as ``__wrapped__``). Without a connection they fail
instead of connecting; the caller treats that as the end of the connection. On a Ray whose
calls are not wrapped this way they are the public calls.
"""

from __future__ import annotations

from typing import Any


def _bare(fn):
    return getattr(fn, "__wrapped__", fn)


def get(ray, refs, timeout: float | None = None) -> Any:
    return _bare(ray.get)(refs, timeout=timeout)


def wait(ray, refs: list, *, num_returns: int, timeout: float | None) -> tuple[list, list]:
    return _bare(ray.wait)(refs, num_returns=num_returns, timeout=timeout)


def kill(ray, actor) -> None:
    _bare(ray.kill)(actor, no_restart=True)


def call(method, *args):
    """``actor.method.remote(*args)``, without auto-init."""
    return _bare(type(method)._remote)(method, args=args, kwargs={})

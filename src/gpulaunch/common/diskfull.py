"""A write that failed because the disk is full, said so: ``No space left on device`` and the
folder, whatever layer the failure passed through on its way up.

torch reports a full disk in many disguises: ``OSError(ENOSPC)`` from a plain write, a
``RuntimeError`` from the zip writer of ``torch.save`` (``unexpected pos 704 vs 598``,
``PytorchStreamWriter failed writing file``), or torch DCP's ``CheckpointException`` that wraps
each rank's error. ``explain`` looks through the exception's chain (and DCP's per-rank
failures) for ENOSPC; for the zip writer's messages, which keep no errno, it asks the file
system whether the folder's disk is (nearly) full.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

# torch.save's own messages for a short write (no errno survives in them)
_SHORT_WRITE = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")
NEARLY_FULL_BYTES = 1 << 20      # less free than this after a failed write: the disk is full


def _causes(exc: BaseException, depth: int = 0):
    """The exception, its causes and contexts, and DCP's per-rank failures."""
    if exc is None or depth > 20:
        return
    yield exc
    failures = getattr(exc, "failures", None)          # torch DCP's CheckpointException
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = getattr(failure, "exc", failure)    # DCP's _WrappedException
            if isinstance(inner, BaseException):
                yield from _causes(inner, depth + 1)
    for nxt in (exc.__cause__, exc.__context__):
        if nxt is not None:
            yield from _causes(nxt, depth + 1)


def _free_bytes(folder: str) -> int | None:
    path = os.path.abspath(folder)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_disk_full(exc: BaseException, folder: str) -> bool:
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in _text(e) or "Disk quota exceeded" in _text(e):
            return True
    if any(m in _text(e) for e in _causes(exc) for m in _SHORT_WRITE):
        free = _free_bytes(folder)
        return free is not None and free < NEARLY_FULL_BYTES
    return False


@contextlib.contextmanager
def named(folder, what: str = "writing"):
    """Inside: a failure caused by a full disk becomes ``explain``'s error (from it)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:        # torch DCP's CheckpointException is a BaseException
        raise_if_full(e, str(folder), what)
        raise


def raise_if_full(exc: BaseException, folder: str, what: str = "writing") -> None:
    """Raise ``explain``'s error from ``exc`` when the disk was full; else return (re-raise
    ``exc`` yourself)."""
    why = explain(exc, folder, what)
    if why is not exc:
        raise why from exc


def explain(exc: BaseException, folder: str, what: str = "writing") -> BaseException:
    """``OSError(ENOSPC)`` naming the folder and its free space when ``exc`` comes from a full
    disk; else ``exc`` itself."""
    if isinstance(exc, OSError) and getattr(exc, "filename", None) == str(folder) and \
            exc.errno == errno.ENOSPC:
        return exc                                      # already explained (a nested save)
    if not is_disk_full(exc, str(folder)):
        return exc
    free = _free_bytes(str(folder))
    try:
        total = shutil.disk_usage(str(folder)).total
        room = f"; {free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB there" \
            if free is not None else ""
    except OSError:
        room = ""
    return OSError(errno.ENOSPC, f"No space left on device while {what} in {folder}{room}. "
                   "Free space there, point the checkpoints at a larger disk, or keep fewer "
                   "(keep=N)", str(folder))


def _text(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001
        return ""

"""What a rank started by torchrun has, and a forked rank would not: called once at the start of
every rank (cold) and of every call served by a warm rank, after its output is on its log.

* **Its own torch seed.** torchrun starts each rank as a fresh interpreter, whose default torch
  generator is seeded from the OS, so ``torch.initial_seed()`` and unseeded ``torch.rand`` differ
  per rank. A forked rank inherits its parent's generator (equal on every rank), and a warm rank
  the previous call's: reseed from the OS, as a fresh process would. A seed the user sets inside
  the function or script (``torch.manual_seed``) runs after this and wins.
* **stderr on stderr.** stdout and stderr share the rank's one ordered log file; lines written
  through ``sys.stderr`` are marked (``caller.logstream.STDERR_MARK``) so the caller prints them
  on its stderr. Bytes written to file descriptor 2 below Python (a C library, faulthandler)
  carry no mark and are shown with stdout.
* **torchelastic's error file.** ``TORCHELASTIC_ERROR_FILE`` points into the attempt's folder, so
  ``@record`` (torch.distributed.elastic.multiprocessing.errors) writes the failure there, and
  the caller reads it when a rank leaves no other record (``caller.collect``).
* **torchrun's role name**: ``ROLE_NAME`` is ``--role`` (``default`` unless given).
* **A findable process.** The process title is the rank's command line
  (``python -u train.py --lr 3``), so ``ps`` and ``pgrep -f train.py`` find the ranks.
"""

from __future__ import annotations

import io
import os
import sys

from ..common.constants import STDERR_MARK

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def apply(run, attempt: int, rank: int) -> None:
    """Give this rank torchrun's start-up state (see the module docstring)."""
    reseed_torch()
    mark_stderr()
    os.environ[ERROR_FILE_ENV] = str(error_file(run, attempt, rank))
    os.environ["ROLE_NAME"] = os.environ.get("GPULAUNCH_ROLE") or "default"   # torchrun's --role
    try:
        entry = run.launch().entry
        set_title(entry.kind, list(entry.argv), rank)
    except Exception:  # noqa: BLE001 - a title is a convenience, never a failure
        pass


def error_file(run, attempt: int, rank: int):
    return run.rank_file(attempt, rank, "error.json")


def reseed_torch() -> None:
    """A fresh, OS-random seed for torch's default generator (and CUDA's, lazily)."""
    torch = sys.modules.get("torch")
    if torch is not None:           # not imported yet: its import seeds it from the OS anyway
        torch.seed()


class _MarkedStderr(io.RawIOBase):
    """File descriptor 2, every line starting with the stderr mark."""

    def __init__(self, fd: int = 2):
        super().__init__()
        self._fd = fd
        self._line_start = True

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def write(self, b) -> int:
        data = bytes(b)
        if not data:
            return 0
        marked = data.replace(b"\n", b"\n" + STDERR_MARK)
        if self._line_start:
            marked = STDERR_MARK + marked
        self._line_start = data.endswith(b"\n")
        if self._line_start:
            marked = marked[:-len(STDERR_MARK)]
        view = memoryview(marked)
        while view:
            view = view[os.write(self._fd, view):]
        return len(data)


def mark_stderr() -> None:
    marked = getattr(sys.stderr, "buffer", None)
    if isinstance(marked, _MarkedStderr):
        marked._line_start = True   # a warm rank's next call: a new log, a new line
        return
    stream = io.TextIOWrapper(_MarkedStderr(2), encoding=getattr(sys.stderr, "encoding", None)
                              or "utf-8", errors="backslashreplace", write_through=True)
    sys.stderr = sys.__stderr__ = stream


def set_title(kind: str, argv: list[str], rank: int) -> None:
    """``ps`` shows what torchrun's rank would show: the interpreter and the command."""
    try:
        import setproctitle
    except ImportError:
        return
    python = os.path.basename(sys.executable) or "python"
    if kind == "script":
        title = [python, "-u", *argv]
    elif kind == "module":
        title = [python, "-u", "-m", *argv]
    elif kind == "function":
        title = [python, "-u", "-m", "gpulaunch.rank", f"rank={rank}", *argv]
    else:
        return                      # exec: execvp gives the program its own command line
    setproctitle.setproctitle(" ".join(title))

"""Stream every rank's log file to the caller as whole, prefixed lines.

Ranks write to their own files (no shared pipe, so lines of different ranks never tear each
other); the caller tails those files and prints complete lines as ``[rank N] ...``.

A rank's stdout and stderr share one ordered log file. Lines the rank wrote through Python's
``sys.stderr`` start with ``STDERR_MARK`` (an invisible ASCII record separator, put there by
``rank.torchrun_env``); the caller prints those on its own stderr, as torchrun does, and strips
the mark wherever a log is shown (``tail_text``, ``split_streams``).

Memory stays bounded whatever the ranks print: a file is read ``CHUNK_BYTES`` at a time and each
chunk printed before the next is read, and an unterminated line is cut every
``MAX_LINE_BYTES``. The log file itself keeps everything.

Progress bars (tqdm and friends) redraw a line with ``\\r``. Printed raw from several ranks that
becomes noise, so a line's ``\\r`` segments collapse to the latest one: it is shown when the line
ends, and a long-running bar is re-shown at most every ``progress_interval`` seconds.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

from ..common.constants import STDERR_MARK

CHUNK_BYTES = 1 << 20          # read per file per step: the caller's buffer, whatever the flood
MAX_LINE_BYTES = 1 << 20       # an unterminated line is printed in pieces this long


@dataclasses.dataclass(frozen=True)
class Console:
    """How ``gpulaunch run`` shows rank output (torchrun's --redirects, --local-ranks-filter,
    --log-line-prefix-template). The process-wide default is set once by the command line."""

    hidden: frozenset = frozenset()     # (local_rank or None for every rank, "stdout"/"stderr")
    prefix: Callable[[int, int], str] | None = None   # (rank, local_rank) -> prefix
    nproc_per_node: int = 0             # to turn a global rank into a local one (0: same)

    def hides(self, rank: int, stream: str) -> bool:
        local = rank % self.nproc_per_node if self.nproc_per_node else rank
        return (None, stream) in self.hidden or (local, stream) in self.hidden


CONSOLE = Console()


def set_console(console: Console) -> None:
    global CONSOLE
    CONSOLE = console


class _Tail:
    __slots__ = ("path", "offset", "partial", "last_progress")

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""
        self.last_progress = 0.0


class LogStreamer:
    def __init__(self, *, prefix: Callable[[int], str] | None = None,
                 show: Callable[[int], bool] = lambda r: True,
                 write: Callable[[str], None] | None = None, progress_interval: float = 5.0,
                 write_err: Callable[[str], None] | None = None):
        console = CONSOLE
        if prefix is None and console.prefix is not None:
            n = console.nproc_per_node
            prefix = lambda r: console.prefix(r, r % n if n else r)  # noqa: E731
        self.prefix = prefix or (lambda r: f"[rank {r}] ")
        self.show = show
        self.console = console
        # stderr lines go to the caller's stderr, unless the caller collects output itself
        self.write = write or _stdout_write
        self.write_err = write_err or (write if write is not None else _stderr_write)
        self.progress_interval = progress_interval
        self._tails: dict[Path, tuple[int, _Tail]] = {}

    def watch(self, rank: int, path: Path) -> None:
        if path not in self._tails:
            self._tails[path] = (rank, _Tail(path))

    def pump(self, final: bool = False) -> None:
        """Print what is new in every watched file, as complete lines, a chunk at a time."""
        for rank, tail in self._tails.values():
            if not self.show(rank):
                continue
            try:
                f = open(tail.path, "rb")
            except FileNotFoundError:
                continue
            with f:
                f.seek(tail.offset)
                while True:
                    chunk = f.read(CHUNK_BYTES)
                    tail.offset += len(chunk)
                    self._emit(rank, tail, chunk, final and len(chunk) < CHUNK_BYTES)
                    if len(chunk) < CHUNK_BYTES:
                        break

    def _emit(self, rank: int, tail: _Tail, chunk: bytes, final: bool) -> None:
        if not chunk and not (final and tail.partial):
            return
        data = tail.partial + chunk if tail.partial else chunk
        lines = data.split(b"\n")
        tail.partial = lines.pop()
        if len(tail.partial) > MAX_LINE_BYTES:       # a huge line with no end yet: print it
            lines.append(tail.partial)
            tail.partial = b""
        if final and tail.partial:
            lines.append(tail.partial)
            tail.partial = b""
        out: list[str] = []
        err: list[str] = []
        for line in lines:
            self._add(rank, line, out, err)
        if tail.partial and b"\r" in tail.partial:
            now = time.monotonic()
            if now - tail.last_progress >= self.progress_interval:
                tail.last_progress = now
                self._add(rank, tail.partial, out, err)
        del lines, data
        if out:
            self.write("".join(out))
        if err:
            self.write_err("".join(err))

    def _add(self, rank: int, raw: bytes, out: list, err: list) -> None:
        is_err = raw.startswith(STDERR_MARK)
        if is_err:
            raw = raw[len(STDERR_MARK):]
        if self.console.hides(rank, "stderr" if is_err else "stdout"):
            return
        text = self._render(rank, raw)
        if text is not None:
            (err if is_err else out).append(text)

    def _render(self, rank: int, raw: bytes) -> str | None:
        text = raw.decode("utf-8", errors="replace")
        if "\r" in text:
            segments = [s for s in text.split("\r") if s.strip()]
            if not segments:
                return None
            text = segments[-1]
        return f"{self.prefix(rank)}{text.rstrip()}\n"


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stderr_write(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def split_streams(path: Path) -> dict[str, bytes]:
    """A rank's log as torchrun would have written it: {'stdout': ..., 'stderr': ...}."""
    streams = {"stdout": [], "stderr": []}
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(STDERR_MARK):
                streams["stderr"].append(line[len(STDERR_MARK):])
            else:
                streams["stdout"].append(line)
    return {k: b"".join(v) for k, v in streams.items()}


def tail_text(path: Path, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a file, progress-bar redraws collapsed, stream marks gone."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    mark = STDERR_MARK.decode()
    out = []
    for line in text.split("\n"):
        if line.startswith(mark):
            line = line[len(mark):]
        if "\r" in line:
            segs = [s for s in line.split("\r") if s.strip()]
            line = segs[-1] if segs else ""
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out[-lines:])

"""Stream every rank's log file to the caller as whole, prefixed lines.

Ranks write to their own files (no shared pipe, so lines of different ranks never tear each
other); the caller tails those files and prints complete lines as ``[rank N] ...``.

Progress bars (tqdm and friends) redraw a line with ``\\r``. Printed raw from several ranks that
becomes noise, so a line's ``\\r`` segments collapse to the latest one: it is shown when the line
ends, and a long-running bar is re-shown at most every ``progress_interval`` seconds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable


class _Tail:
    __slots__ = ("path", "offset", "partial", "last_progress")

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""
        self.last_progress = 0.0


class LogStreamer:
    def __init__(self, *, prefix: Callable[[int], str] = lambda r: f"[rank {r}] ",
                 show: Callable[[int], bool] = lambda r: True,
                 write: Callable[[str], None] | None = None, progress_interval: float = 5.0):
        self.prefix = prefix
        self.show = show
        self.write = write or _stdout_write
        self.progress_interval = progress_interval
        self._tails: dict[Path, tuple[int, _Tail]] = {}

    def watch(self, rank: int, path: Path) -> None:
        if path not in self._tails:
            self._tails[path] = (rank, _Tail(path))

    def pump(self, final: bool = False) -> None:
        """Read what is new in every watched file and print complete lines."""
        for rank, tail in self._tails.values():
            if not self.show(rank):
                continue
            try:
                with open(tail.path, "rb") as f:
                    f.seek(tail.offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk and not (final and tail.partial):
                continue
            tail.offset += len(chunk)
            data = tail.partial + chunk
            lines = data.split(b"\n")
            tail.partial = lines.pop()
            out = [self._render(rank, line) for line in lines]
            if final and tail.partial:
                out.append(self._render(rank, tail.partial))
                tail.partial = b""
            elif b"\r" in tail.partial:
                now = time.monotonic()
                if now - tail.last_progress >= self.progress_interval:
                    tail.last_progress = now
                    out.append(self._render(rank, tail.partial))
            out = [o for o in out if o is not None]
            if out:
                self.write("".join(out))

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


def tail_text(path: Path, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a file, progress-bar redraws collapsed."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    out = []
    for line in text.split("\n"):
        if "\r" in line:
            segs = [s for s in line.split("\r") if s.strip()]
            line = segs[-1] if segs else ""
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out[-lines:])

"""Live post-mortem debugging of a failing rank (``debug=True``).

When the rank's function raises, this rank stops at the raising frame and serves ``pdb`` on a
loopback socket (127.0.0.1, an ephemeral port) before it reports its failure. The port and a
one-time token go into ``rank<r>.debug.json`` in the run directory (owner-only, like the whole
run directory); ``gpulaunch debug RUN --rank N`` reads them and attaches. The first connection
that presents the token gets the session and the listener closes: nobody attaches twice, and
without the token nobody attaches at all (a wrong token is refused, the wait goes on).

The other ranks are not touched: they wait (in a collective, or finished). The session ends
with ``c``/``q`` or a closed connection; an unattended rank gives up after ``WAIT_S``; then it
reports its error as usual and the run ends.
"""

from __future__ import annotations

import hmac
import json
import os
import pdb
import secrets
import socket
import sys
import time

WAIT_S = 600.0          # how long a failing rank waits for a debugger to attach
IDLE_S = 1800.0         # an attached session with no input for this long is ended
TOKEN_LINE_MAX = 256


def enabled() -> bool:
    return os.environ.get("GPULAUNCH_DEBUG", "").strip().lower() in ("1", "true", "yes")


def serve(tb, info_path, *, rank: int, attach_hint: str, wait: float = WAIT_S) -> bool:
    """Serve one pdb session on ``tb``; True when a debugger attached."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        token = secrets.token_urlsafe(24)
        _write_private(info_path, {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                                   "port": listener.getsockname()[1], "token": token})
        sys.stderr.write(f"gpulaunch: rank {rank} stopped at its error and waits up to "
                         f"{wait:g} s for a debugger: {attach_hint}\n")
        sys.stderr.flush()
        conn = _accept_with_token(listener, token, time.monotonic() + wait)
    finally:
        listener.close()                  # one session only: nothing listens any more
        try:
            os.unlink(info_path)
        except OSError:
            pass
    if conn is None:
        sys.stderr.write(f"gpulaunch: no debugger attached to rank {rank} within {wait:g} s\n")
        return False
    conn.settimeout(IDLE_S)
    # Two streams, not one "rw" file: a text stream that writes drops what it had read ahead,
    # and pdb's next commands would be lost.
    reader = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")
    writer = conn.makefile("w", encoding="utf-8", errors="replace", newline="\n")
    try:
        debugger = pdb.Pdb(stdin=reader, stdout=writer)
        debugger.reset()
        debugger.interaction(None, tb)
    except (OSError, ValueError):        # the client went away, or stayed idle too long
        pass
    finally:
        for closing in (writer.close, reader.close, conn.close):
            try:
                closing()
            except OSError:
                pass
    return True


def _accept_with_token(listener, token: str, deadline: float):
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except (TimeoutError, socket.timeout):
            return None
        conn.settimeout(10.0)
        try:
            line = _read_line(conn)
        except OSError:
            conn.close()
            continue
        if hmac.compare_digest(line.encode(), token.encode()):
            conn.sendall(b"gpulaunch: attached\n")
            return conn
        try:
            conn.sendall(b"gpulaunch: wrong token\n")
        except OSError:
            pass
        conn.close()


def _read_line(conn) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < TOKEN_LINE_MAX:
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _write_private(path, data: dict) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)

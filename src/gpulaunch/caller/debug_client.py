"""``gpulaunch debug RUN --rank N``: attach to a rank that stopped at its error (``debug=True``,
``rank/debugger.py``) and bridge this terminal (or any line streams) to its pdb session."""

from __future__ import annotations

import socket
import sys
import threading
import time

from ..common.rundir import RunDir, hostname, read_json
from ..errors import ConfigurationError


def wait_for_session(run: RunDir, rank: int, wait: float) -> dict:
    """The rank's debug.json once it appears (its error happened and it listens)."""
    deadline = time.monotonic() + wait
    while True:
        attempts = run.attempts()
        info = read_json(run.rank_file(attempts[-1], rank, "debug.json")) if attempts else None
        if info:
            return info
        if time.monotonic() > deadline:
            raise ConfigurationError(
                f"rank {rank} of run {run.run_id} is not waiting for a debugger (no "
                f"debug.json within {wait:g} s): launch with debug=True, and attach while the "
                "rank is stopped at its error")
        time.sleep(0.1)


def attach(run: RunDir, rank: int, *, wait: float = 30.0, stdin=None, stdout=None) -> int:
    """Run one pdb session against rank ``rank``; returns when the session ends."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    info = wait_for_session(run, rank, wait)
    if info.get("host") not in (hostname(), socket.gethostname()):
        raise ConfigurationError(f"rank {rank} listens on the loopback of host {info['host']}: "
                                 "run `gpulaunch debug` there")
    conn = socket.create_connection(("127.0.0.1", int(info["port"])), timeout=10)
    conn.settimeout(None)
    conn.sendall(info["token"].encode() + b"\n")

    def copy_out():
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                break
            if not data:
                break
            stdout.write(data.decode("utf-8", "replace"))
            stdout.flush()

    def copy_in():
        try:
            for line in stdin:
                conn.sendall(line.encode())
            conn.shutdown(socket.SHUT_WR)   # end of our input: pdb sees EOF and quits
        except OSError:
            pass

    # The session's end is the rank closing the connection (``c``, ``q``): then we return
    # at once, even while a terminal's stdin still waits for a line.
    threading.Thread(target=copy_in, daemon=True).start()
    try:
        copy_out()
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()
    return 0

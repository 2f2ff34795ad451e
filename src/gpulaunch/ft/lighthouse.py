"""The torchft lighthouse of a fault-tolerant run: started and supervised by gpulaunch, or given.

The lighthouse decides, step after step, which replica groups form the quorum (torchft's
``LighthouseServer``; gpulaunch writes no quorum protocol of its own). It runs in a child
process of the caller so that a crash of it is seen (``alive()``) and repaired (``restart()``
on the same port: the replicas' managers reconnect to the address they were given). The child
reads its stdin and exits when it closes, so a caller that dies (even by SIGKILL) never leaves
a lighthouse behind; it also asks the kernel for SIGKILL when its parent dies.

    lh = Lighthouse.start()                  # on this host, loopback, a free port
    lh.address                               # "http://127.0.0.1:PORT" for TORCHFT_LIGHTHOUSE
    lh.stop()

    python -m gpulaunch.ft._lighthouse_child --port 29510   # the same by hand; Ctrl-D stops it
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

from ..errors import ConfigurationError, LaunchError

# run by path: the child imports neither gpulaunch nor torch (it starts in ~0.1 s)
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lighthouse_child.py")


class LighthouseError(LaunchError):
    """The lighthouse did not start, or died more often than ``max_restarts`` allows."""


class Lighthouse:
    """A lighthouse process on this host (``start``), or one running elsewhere (``at``)."""

    def __init__(self, address: str, proc: subprocess.Popen | None = None,
                 settings: dict | None = None):
        self.address = address
        self._proc = proc
        self._settings = settings or {}
        self.restarts = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def at(cls, address: str) -> "Lighthouse":
        """A lighthouse someone else runs (``http://host:port``): used as is, never restarted."""
        if not isinstance(address, str) or not address.startswith(("http://", "https://")):
            raise ConfigurationError(f"lighthouse={address!r}: give its address as "
                                     "'http://host:port' (torchft_lighthouse --bind prints it).")
        return cls(address)

    @classmethod
    def start(cls, *, host: str = "127.0.0.1", port: int = 0, min_replicas: int = 1,
              join_timeout_ms: int = 1000, quorum_tick_ms: int = 20,
              heartbeat_timeout_ms: int = 1000, start_timeout: float = 60.0) -> "Lighthouse":
        """Start a lighthouse child process bound to ``host:port`` (0: a free port).

        heartbeat_timeout_ms: how long a silent replica group (a SIGKILLed one) still counts as
            alive; the survivors' next quorum waits for it (torchft's default is 5000).
        join_timeout_ms: how long a new quorum waits for stragglers that are alive but late.
        quorum_tick_ms: how often the lighthouse looks for a quorum; every step waits for one
            tick at most (torchft's default, 100, costs short CPU steps a few steps per second).
        """
        settings = dict(host=host, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                        quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms,
                        start_timeout=start_timeout)
        proc, bound = _spawn(port=port, **settings)
        lh = cls(f"http://{host}:{bound}", proc, settings)
        lh.port = bound
        return lh

    # ------------------------------------------------------------------ supervision
    @property
    def managed(self) -> bool:
        """True when this object started the lighthouse (and so may restart and stop it)."""
        return self._proc is not None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        """False once a lighthouse we started has exited (one given by address: always True)."""
        return self._proc is None or self._proc.poll() is None

    def restart(self) -> None:
        """Start the lighthouse again on the same port (its quorum state starts empty; the
        managers keep their step and rejoin at their next quorum)."""
        if self._proc is None:
            raise LighthouseError(f"the lighthouse at {self.address} is not run by gpulaunch "
                                  "and cannot be restarted from here.")
        self._close(self._proc)
        self._proc, _ = _spawn(port=self.port, **self._settings)
        self.restarts += 1

    def stop(self) -> None:
        if self._proc is not None:
            self._close(self._proc)

    @staticmethod
    def _close(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                proc.stdin.close()            # the child's signal to leave
            except OSError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "managed" if self.managed else "external"
        return f"<Lighthouse {self.address} {state} restarts={self.restarts}>"


def _spawn(*, port: int, host: str, min_replicas: int, join_timeout_ms: int,
           quorum_tick_ms: int, heartbeat_timeout_ms: int, start_timeout: float):
    """Start the child and wait for the port it bound (retried briefly: a port freed by a
    lighthouse that just died can take a moment to bind again)."""
    cmd = [sys.executable, _CHILD, "--host", host, "--port", str(port),
           "--min-replicas", str(min_replicas), "--join-timeout-ms", str(join_timeout_ms),
           "--quorum-tick-ms", str(quorum_tick_ms),
           "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
    deadline = time.monotonic() + start_timeout
    last = ""
    while True:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        line = _read_line(proc, deadline)
        if line.startswith("LIGHTHOUSE "):
            # stderr is drained by nobody from here on: the child sends its logs to devnull
            proc.stderr.close()
            return proc, int(line.split()[1])
        err = ""
        if proc.poll() is None:
            proc.kill()
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        last = (err or b"").decode(errors="replace").strip()[-2000:]
        if time.monotonic() > deadline or "address" not in last.lower():
            raise LighthouseError(f"the torchft lighthouse did not start on {host}:{port}: "
                                  f"{last or 'no output'}. Is torchft installed "
                                  "(pip install 'gpulaunch[ft]')?")
        time.sleep(0.2)


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 256)
            if not chunk:
                return buf.decode(errors="replace")
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode(errors="replace")
        elif proc.poll() is not None:
            return buf.decode(errors="replace")
    return buf.decode(errors="replace")

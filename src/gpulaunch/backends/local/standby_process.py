"""The standby agent's own process: ``python -m gpulaunch.backends.local.standby_process``.

Started ahead by ``standby.StandbyAgent.replenish`` (the caller side, in ``standby.py``): it
imports torch and the agent, says ``ready``, and waits for one request line on stdin (the run
directory, environment and working directory of the call that takes it), then becomes that
run's agent. EOF before a request: the caller ended or discarded it; exit quietly.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def _read_request(got: threading.Event, box: list) -> None:
    """Read the one request line from stdin, without reading past it: after it, stdin belongs
    to the agent's caller-death watch. EOF first (the caller ended or discarded us): exit."""
    data = b""
    try:
        while not data.endswith(b"\n"):
            chunk = os.read(0, 1 << 16)
            if not chunk:
                os._exit(0)
            data += chunk
    except OSError:
        os._exit(0)
    box.append(json.loads(data))
    try:
        os.write(1, b"ack\n")
    except OSError:
        pass
    got.set()


def _serve() -> None:
    # Start listening before the slow imports, so that a caller that exits while we import
    # torch does not leave us running for seconds.
    got, box = threading.Event(), []
    threading.Thread(target=_read_request, args=(got, box), daemon=True).start()
    start_cwd = os.getcwd()
    from . import agent  # torch, torchelastic, the worker: the point of it all
    try:
        os.write(1, b"ready\n")         # for wait_ready(); fd 1 becomes the run's log below
    except OSError:
        pass
    got.wait()
    request = box[0]
    os.environ.clear()
    os.environ.update(request["env"])
    cwd = request["cwd"]
    if cwd != start_cwd:
        os.chdir(cwd)
        if sys.path and sys.path[0] == start_cwd:   # `python -m` put the start directory first
            sys.path[0] = cwd
    log = os.open(os.path.join(request["run_dir"], "agent.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    agent.run_and_exit([request["run_dir"], "--node-rank", "0", "--watch-stdin", "--warm"])


if __name__ == "__main__":
    _serve()

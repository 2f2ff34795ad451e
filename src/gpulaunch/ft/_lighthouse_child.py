"""The lighthouse process: torchft's ``LighthouseServer`` until its stdin closes.

Run by path (``python .../_lighthouse_child.py --port P``), it imports neither gpulaunch nor
torch: torchft's Rust extension is loaded on its own, which takes milliseconds where
``import torchft`` (it imports torch) takes seconds; a restarted lighthouse is back at once.
Prints ``LIGHTHOUSE <port>`` when it listens.
"""

import argparse
import ctypes
import importlib.util
import os
import signal
import sys


def _load_extension():
    """torchft's compiled module without the torchft package (and so without torch)."""
    try:
        spec = importlib.util.find_spec("torchft")
        for folder in spec.submodule_search_locations or ():
            for name in os.listdir(folder):
                if name.startswith("_torchft.") and name.endswith((".so", ".pyd")):
                    ext = importlib.util.spec_from_file_location(
                        "torchft._torchft", os.path.join(folder, name))
                    module = importlib.util.module_from_spec(ext)
                    ext.loader.exec_module(module)
                    return module
    except Exception:  # noqa: BLE001 - another layout: the ordinary import below
        pass
    from torchft import _torchft
    return _torchft


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="a torchft lighthouse that stops when stdin closes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--join-timeout-ms", type=int, default=1000)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    a = p.parse_args(argv)
    if sys.platform.startswith("linux"):      # die with the caller, even a SIGKILLed one
        ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
    server = _load_extension().LighthouseServer(
        bind=f"{a.host}:{a.port}", min_replicas=a.min_replicas,
        join_timeout_ms=a.join_timeout_ms, quorum_tick_ms=a.quorum_tick_ms,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    port = int(server.address().rsplit(":", 1)[1].strip("/"))
    # It logs every quorum on stderr and nobody reads that once it runs (the caller closes its
    # end as soon as it has the port, so this comes first).
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.stdout.write(f"LIGHTHOUSE {port}\n")
    sys.stdout.flush()
    try:
        while sys.stdin.buffer.read(1024):     # until EOF: the caller closed it or died
            pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

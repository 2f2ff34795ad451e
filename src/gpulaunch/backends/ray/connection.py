"""Is this process still connected to the Ray cluster?

After ``ray.shutdown()`` (or a lost head) any actor call would silently ``ray.init()`` a *new*
connection (Ray's auto-init), to a cluster that may be gone: never do that (``calls.py``). The
job's actors are owned by this driver, so Ray itself kills them (and with them the ranks) when
it disconnects; the run then ends as DISCONNECTED.
"""

from __future__ import annotations

import time


class Connection:
    def __init__(self, ray):
        self.ray = ray
        self.ended = False

    def alive(self) -> bool:
        if self.ended:
            return False
        if self.ray is not None and not self.ray.is_initialized():
            self.ended = True
            return False
        return True

    def ending(self, within: float = 5.0) -> bool:
        """After a Ray call failed: is this because the connection is ending?
        ``ray.shutdown()`` marks the connection closed only at its end, so give it a moment."""
        deadline = time.monotonic() + within
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

"""What each replica group's rank runs (``run_replicas`` launches it): the user's function, a
warm spare's wait for the replica it replaces, and the "ended well" marker the caller reads."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .replicated import ENV_ATTEMPT, ENV_DIR, ENV_REPLICA

ENV_SPARE = "GPULAUNCH_FT_SPARE"          # a spare's assignment file (it waits for it)


def replica_entry(fn, args, kwargs):
    """What each replica group's rank runs. A spare has torch and torchft imported and its
    process group up, then waits for the caller to name the replica it replaces; that saves a
    restarted group the launch and the imports (seconds on a busy host)."""
    assignment = os.environ.get(ENV_SPARE)
    if assignment:
        import torch
        import torchft  # noqa: F401 - imported now, while there is time

        from .. import runtime as rt
        rt.init()
        # The first optimizer built in a process imports torch._dynamo: seconds, paid here.
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
        while not os.path.exists(assignment):
            time.sleep(0.01)
        with open(assignment) as f:
            os.environ.update(json.load(f))
    out = fn(*args, **kwargs)
    # The rank's process ends now: tell the caller it ends well, not by a crash.
    folder = os.environ.get(ENV_DIR)
    if folder:
        Path(folder, f"replica{os.environ.get(ENV_REPLICA)}.attempt"
                     f"{os.environ.get(ENV_ATTEMPT)}.done").touch()
    return out

"""Start a recipe's training function on every rank.

Normally through gpulaunch. When the script was itself started by ``torchrun`` or ``accelerate
launch`` (to compare gpulaunch with them on the same script), this process already is one rank:
run the function here, and hand back rank 0's result only.
"""

from __future__ import annotations

import os


def externally_launched() -> bool:
    """A rank of another launcher: the torchrun environment, but not gpulaunch's run."""
    return os.environ.get("RANK") is not None and not os.environ.get("GPULAUNCH_RUN_DIR")


def as_this_rank(train, opts) -> list | None:
    """Under another launcher: run here; [rank 0's result] on rank 0, None elsewhere."""
    from gpulaunch import runtime as rt
    result = train(opts)
    return [result] if rt.is_main() else None


def gpus_here() -> int:
    """GPUs gpulaunch would use on this machine (0 with GPULAUNCH_FORCE_CPU=1), decided before
    launching anything. gpulaunch's own detection when importable (it moves with the
    launcher's refactor), else torch's count, which needs no CUDA context."""
    if os.environ.get("GPULAUNCH_FORCE_CPU") == "1":
        return 0
    try:
        from gpulaunch.launch import hardware
        return len(hardware.detect().gpus)
    except (ImportError, AttributeError):
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

"""``gpulaunch.parallel``: one ``prepare()`` for DDP, FSDP2 (HSDP, tensor and context parallel through
``mesh=Mesh(...)``) and DeepSpeed ZeRO-1/2/3, checkpoints
that every strategy saves and loads atomically, ``export()`` to one plain file, and data helpers.

    from gpulaunch.parallel import prepare, save_checkpoint, load_checkpoint

    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=3e-4), strategy="fsdp",
                mixed_precision="bf16", compile=True)
    for step, (x, y) in enumerate(loader, 1):
        loss = p.model(x, y)
        p.backward(loss); p.step(); p.zero_grad()
        if step % 100 == 0:
            save_checkpoint("ckpts/", p, step=step)

See docs/choosing-a-technique.md for which strategy to pick.
"""

from ._env import ParallelError
from .blocks import find_blocks
from .checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    wait_for_checkpoint,
)
from .data import (
    DistributedLoader,
    ShardedFileDataset,
    distributed_loader,
    read_lines,
    seed_everything,
)
from .export import export
from .loss import chunked_cross_entropy
from .mesh import Mesh
from .preemption import save_on_preemption
from .resume import resume
from .strategies import (
    PRECISIONS,
    STRATEGIES,
    Prepared,
    PrepareSettings,
    deepspeed_config,
    estimate_training_bytes,
    prepare,
)

__all__ = [
    "PRECISIONS", "STRATEGIES", "DistributedLoader", "Mesh", "ParallelError", "PrepareSettings", "Prepared", "ShardedFileDataset",
    "chunked_cross_entropy", "deepspeed_config", "distributed_loader", "estimate_training_bytes",
    "export", "find_blocks", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "prepare",
    "read_lines", "resume", "save_checkpoint", "save_on_preemption", "seed_everything", "wait_for_checkpoint",
]

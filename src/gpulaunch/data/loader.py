"""``StreamingLoader``: this rank's batches of a :class:`StreamingDataset`, exactly resumable.

    ds = StreamingDataset("s3://bucket/table", columns=["tokens"], seed=0)
    loader = StreamingLoader(ds, batch_size=32, num_workers=4, device="auto")
    step = resume("ckpts/", p)                 # the loader's position comes back with it
    for epoch in loader.epochs(3):             # from the epoch the checkpoint was in
        for batch in loader:                   # from the batch after the last one trained on
            ...
            save_checkpoint("ckpts/", p, step=step)   # carries the loader's state_dict()

Workers: torch's DataLoader runs ``num_workers`` processes, each building its share of the
batches (:mod:`.plan`), reading ahead in threads; batches land in pinned memory when they go to
a GPU, and with ``device=`` the next batch's copy to the GPU is issued before the current one is
handed out, so the step never waits for a host-to-device copy.

State: the epoch and the positions of it that no rank has been handed yet. All ranks step
together, so every rank computes the same state; restored at another world size, worker count or
batch size, the rest of the epoch is split anew and each row is still seen exactly once.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from gpulaunch.errors import DataError

from . import state as registry
from .dataset import StreamingDataset
from .plan import Assignment, merge


class StreamingLoader:
    """Batches of ``batch_size`` rows (per rank) of ``dataset`` for this rank.

    Args:
        dataset: a :class:`StreamingDataset`.
        batch_size: rows per batch on each rank (global batch = batch_size x world size).
        num_workers: DataLoader worker processes (0: read in this process).
        drop_last: drop the epoch's tail so every batch is full (else the last batch of each
            rank is shorter, and a rank one row short repeats one row).
        device: put batches on this device (``"auto"``: this rank's), copied ahead.
        pin_memory: default on when batches go to a GPU.
        prefetch_factor: batches each worker keeps ready.
        rank, world_size: default to this process's (``gpulaunch.runtime``).
        name: under which checkpoints carry this loader's state (``None``: not carried).
    """

    def __init__(self, dataset: StreamingDataset, batch_size: int, *, num_workers: int = 0,
                 drop_last: bool = False, device=None, pin_memory: bool | None = None,
                 prefetch_factor: int = 4, rank: int | None = None,
                 world_size: int | None = None, name: str | None = "train",
                 multiprocessing_context=None):
        from gpulaunch import runtime as rt

        if not isinstance(dataset, StreamingDataset):
            raise DataError(f"StreamingLoader reads a StreamingDataset, got "
                            f"{type(dataset).__name__}; for a map-style dataset use "
                            "gpulaunch.data.distributed_loader")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.dataset, self.batch_size = dataset, batch_size
        self.num_workers, self.drop_last = max(0, int(num_workers)), bool(drop_last)
        self.rank = rt.get_global_rank() if rank is None else int(rank)
        self.world_size = rt.get_world_size() if world_size is None else int(world_size)
        if device == "auto":
            device = rt.device()
        self.device = torch.device(device) if device is not None else None
        self.pin_memory = (self.device is not None and self.device.type == "cuda") \
            if pin_memory is None else bool(pin_memory)
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        self.epoch = 0
        self._remaining = None          # None: the whole epoch
        self._pass: Assignment | None = None
        self._consumed = 0
        self.name = name
        if name is not None:
            registry.register(self, name)

    # ------------------------------------------------------------------ position
    def _full(self):
        return [(0, self.dataset.num_rows)]

    def _plan(self) -> Assignment:
        return Assignment(self._remaining if self._remaining is not None else self._full(),
                          self.world_size, self.num_workers, self.batch_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (a restored position in that same epoch is kept)."""
        if int(epoch) != self.epoch:
            self._settle()
            self.epoch, self._remaining, self._pass, self._consumed = int(epoch), None, None, 0

    def epochs(self, total: int):
        """Epoch numbers from the current (restored) one up to ``total`` - 1; a loop that
        leaves an epoch before its end (a ``break``) ends the epochs too."""
        while self.epoch < total:
            e = self.epoch
            yield e
            self._settle()
            if self.epoch == e:
                if self._remaining != []:
                    return
                self.set_epoch(e + 1)

    def __len__(self) -> int:
        """Batches left in the current epoch for this rank."""
        return (self._pass.num_batches - self._consumed) if self._pass is not None \
            else self._plan().num_batches

    def _settle(self) -> None:
        """Fold the batches handed out in the current pass into the remaining positions."""
        if self._pass is not None:
            self._remaining = self._pass.remaining_after(self._consumed)
            self._pass, self._consumed = None, 0

    def state_dict(self) -> dict:
        rest = self._pass.remaining_after(self._consumed) if self._pass is not None \
            else self._remaining
        epoch, current = self.epoch, None
        if rest == []:                      # the epoch is over: the next one, from its start
            epoch, rest = epoch + 1, None
        elif self._pass is not None:        # same shape on restore: the very same batches
            p = self._pass
            current = {"base": [list(r) for r in p.remaining], "world_size": p.world_size,
                       "num_workers": p.num_workers, "batch_size": p.batch_size,
                       "drop_last": p.drop_last, "consumed": self._consumed}
        return {"epoch": epoch, "remaining": None if rest is None else [list(r) for r in rest],
                "pass": current, "num_rows": self.dataset.num_rows, "seed": self.dataset.seed,
                "shuffle": self.dataset.shuffle, "version": self.dataset.version}

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_rows"]) != self.dataset.num_rows:
            raise DataError(
                f"{self.dataset.source.url}: the checkpoint's loader read {state['num_rows']} rows "
                f"and this dataset has {self.dataset.num_rows}: it is not the same data (pin a "
                "Delta table with version=, or start a new run)")
        if (state.get("seed"), state.get("shuffle")) != (self.dataset.seed, self.dataset.shuffle):
            raise DataError(f"the checkpoint's loader used seed={state.get('seed')}, "
                            f"shuffle={state.get('shuffle')}; this dataset has "
                            f"seed={self.dataset.seed}, shuffle={self.dataset.shuffle}: resuming "
                            "would repeat and skip rows")
        self.epoch = int(state["epoch"])
        rest = state.get("remaining")
        self._remaining = None if rest is None else merge(tuple(r) for r in rest)
        self._pass, self._consumed = None, 0
        p = state.get("pass")
        if p and (p["world_size"], p["num_workers"], p["batch_size"], p["drop_last"]) == (
                self.world_size, max(1, self.num_workers), self.batch_size, self.drop_last):
            # the shape it was saved at: continue that pass, batch for batch
            self._pass = Assignment([tuple(r) for r in p["base"]], self.world_size,
                                    self.num_workers, self.batch_size, self.drop_last)
            self._consumed = int(p["consumed"])

    # ------------------------------------------------------------------ iteration
    def __iter__(self):
        if self._pass is not None and self._consumed >= self._pass.num_batches:
            self._settle()
        if self._pass is None:
            if self._remaining == []:       # finished: the next pass is the next epoch
                self.set_epoch(self.epoch + 1)
            self._pass, self._consumed = self._plan(), 0
        plan, skip = self._pass, self._consumed   # a pass left early goes on where it stopped
        ds = self.dataset.with_job(self.epoch, plan, self.rank, skip)
        if self.num_workers == 0:
            batches = iter(ds)
            if self.pin_memory:
                batches = (_pin(b) for b in batches)
        else:
            batches = iter(DataLoader(
                ds, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor, persistent_workers=False,
                multiprocessing_context=self.multiprocessing_context))
        return self._hand_out(plan, batches)

    def _hand_out(self, plan: Assignment, batches):
        ahead = None
        for b in batches:
            if self.device is not None:
                b = _to_device(b, self.device)      # issued now, overlaps the step in flight
            if ahead is not None:
                yield self._count(plan, ahead)
            ahead = b
        if ahead is not None:
            yield self._count(plan, ahead)
        if self._pass is plan and self._consumed >= plan.num_batches:
            self._settle()

    def _count(self, plan, batch):
        if self._pass is plan:
            self._consumed += 1
        return batch


def _to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _pin(batch):
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return type(batch)(_pin(v) for v in batch)
    return batch

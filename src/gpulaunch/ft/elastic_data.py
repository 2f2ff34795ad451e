"""Data for replica groups that come and go: one stream position for the whole run, cut anew
over the live groups at every step (``Replicated.loader``).

    def train(steps, path):
        model = Net()
        r = ft.replicated(model, torch.optim.AdamW(model.parameters()))
        data = r.loader(StreamingDataset(path, seed=0), batch_size=32)   # before the first step
        while r.step < steps:
            r.optimizer.zero_grad()               # this step's quorum: which groups are live
            for batch in data:                    # this group's shards of the step's rows
                (loss_fn(r.model, batch) * data.weight).backward()
            r.optimizer.step()                    # committed: the stream moves on one global batch

The dataset is read as one endless stream (``gpulaunch.data.stream``: epoch 0's shuffled order,
then epoch 1's, ...). Every step trains the next ``shards x batch_size`` rows of it, the global
batch, whatever the number of live groups: shard ``k`` is rows ``[pos + k*b, pos + (k+1)*b)``,
and the live group of participating rank ``i`` of ``P`` trains shards ``i, i+P, ...``
(:func:`~gpulaunch.ft.elastic.shards_for`, gradient accumulation when ``P < shards``). At the
run's first step, where torchft syncs the groups' weights from one of them and only that one's
gradient counts, every group trains the whole global batch (:func:`step_rows`, ``first``).

The position is a function of the run's committed step: ``pos = anchor_pos + (step -
anchor_step) x global batch``. A committed step moves it on by one global batch on every group
at once; a dropped step (torchft's commit vote said no) does not, so its rows are trained again
at the retry, cut over whichever groups are live then. The anchor ``(pos, step)`` is the
loader's ``state_dict()``; it is registered with torchft's manager, so it travels with the
weights to a group that heals (a replacement, or a group that grows the run back): that group
goes on from the run's position, not from its own. Hence, across any shrink, growth or
replacement, every row of the stream prefix a run has committed was trained exactly once, in a
step that committed (docs/fault-tolerance.md says what a step that dies half-committed does).
"""

from __future__ import annotations

from ..errors import ConfigurationError
from .elastic import shards_for

STATE_KEY = "gpulaunch.data"            # the loader's key in torchft's state dict (+ its name)


# ------------------------------------------------------------------------ the arithmetic (pure)

def position(anchor: tuple[int, int], step: int, rows_per_step: int) -> int:
    """The stream position at the start of run step ``step`` for a loader whose position was
    ``anchor[0]`` at step ``anchor[1]``: each committed step in between took ``rows_per_step``."""
    pos, at = anchor
    if step < at:
        raise ConfigurationError(f"the run is at step {step}, before the data loader's position "
                                 f"was taken (step {at}): the step went back")
    return pos + (step - at) * rows_per_step


def shard_rows(pos: int, shard: int, batch_size: int) -> tuple[int, int]:
    """Stream positions ``[a, b)`` of shard ``shard`` of the step that starts at ``pos``."""
    a = pos + shard * batch_size
    return a, a + batch_size


def step_rows(pos: int, rank: int | None, participants: int, shards: int, batch_size: int,
              *, first: bool = False) -> list[tuple[int, int]]:
    """The runs of stream positions the group of participating ``rank`` (of ``participants``
    live groups; ``None``: healing, it trains rank 0's and torchft zeroes its gradient) trains
    in the step that starts at ``pos``; ``shards`` runs of ``batch_size`` rows a step in all.

    ``first``: the run's first step, where every group trains every shard
    (:func:`~gpulaunch.ft.elastic.shards_for` says why)."""
    return [shard_rows(pos, k, batch_size)
            for k in shards_for(rank, participants, shards, first=first)]


def rank_part(run: tuple[int, int], rank: int, ranks: int) -> tuple[int, int]:
    """The part of a shard's run ``[a, b)`` that rank ``rank`` of a group of ``ranks`` reads: in
    a sharded group (HSDP) every rank trains its own rows, and FSDP2 averages over them, so the
    group's gradient is still the mean over the whole shard."""
    a, b = run
    part = (b - a) // ranks
    return a + rank * part, a + (rank + 1) * part


# ------------------------------------------------------------------------------- the loader

class ElasticLoader:
    """This replica group's batches of each step; made by :meth:`Replicated.loader`.

    Iterate it once per step, after ``optimizer.zero_grad()`` (which starts the step's quorum):
    it yields one batch of ``batch_size`` rows per shard this group trains (in a group of K
    ranks, each rank gets its ``batch_size / K`` of them), holding back the gradient all-reduce
    until the last (DDP's ``no_sync``). Scale each loss by ``weight``.
    """

    def __init__(self, replicated, dataset, batch_size: int, *, shards: int,
                 name: str = "train"):
        from ..data.dataset import StreamingDataset
        from ..data.stream import StreamReader

        if not isinstance(dataset, StreamingDataset):
            raise ConfigurationError(f"r.loader() reads a gpulaunch.data.StreamingDataset, got "
                                     f"{type(dataset).__name__}")
        for what, n in (("batch_size", batch_size), ("shards", shards)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigurationError(f"r.loader({what}={n!r}): an int >= 1")
        # A group of several ranks (HSDP): each reads its part of every shard.
        import torch.distributed as dist
        on = dist.is_available() and dist.is_initialized()
        self.group_rank, self.group_ranks = (dist.get_rank(), dist.get_world_size()) if on \
            else (0, 1)
        if batch_size % self.group_ranks:
            raise ConfigurationError(
                f"r.loader(batch_size={batch_size}) in a replica group of {self.group_ranks} "
                f"ranks: give a multiple of {self.group_ranks} (each rank reads its part of "
                "every shard)")
        self.dataset, self.batch_size = dataset, batch_size
        self.shards = shards
        self._r = replicated
        self._anchor = (0, replicated.step)
        self._reader = StreamReader(dataset)
        self.rows: list[tuple[int, int]] = []   # the runs of positions of the last iteration
        self.participating = False              # whether they count (False: healing)
        self.key = f"{STATE_KEY}.{name}"
        replicated.manager.register_state_dict_fn(self.key, self.load_state_dict,
                                                  self.state_dict)

    @property
    def rows_per_step(self) -> int:
        """The global batch in rows: ``shards x batch_size``."""
        return self.shards * self.batch_size

    @property
    def position(self) -> int:
        """Rows of the stream the run has committed so far (at the run's current step)."""
        return position(self._anchor, self._r.step, self.rows_per_step)

    @property
    def epoch(self) -> int:
        return self.position // self.dataset.num_rows

    @property
    def weight(self) -> float:
        """What to scale each shard's loss by (``Replicated.shard_weight``)."""
        return self._r.shard_weight(self.shards)

    def state_dict(self) -> dict:
        d = self.dataset
        return {"pos": self.position, "step": self._r.step, "num_rows": d.num_rows,
                "seed": d.seed, "shuffle": d.shuffle, "version": d.version}

    def load_state_dict(self, state: dict) -> None:
        d = self.dataset
        mine = (d.num_rows, d.seed, d.shuffle)
        theirs = (state.get("num_rows"), state.get("seed"), state.get("shuffle"))
        if mine != theirs:
            raise ConfigurationError(
                f"a data loader position for (rows, seed, shuffle) = {theirs}, and this "
                f"loader's dataset has {mine}: the groups would read different streams (build "
                "the same StreamingDataset in every group; pin a Delta table with version=)")
        self._anchor = (int(state["pos"]), int(state["step"]))

    def __iter__(self):
        r = self._r
        rank, participants = r.manager.participating_rank(), r.participants
        pos, first = self.position, r.step == 0
        self.rows = step_rows(pos, rank, participants, self.shards, self.batch_size,
                              first=first)
        self.participating = r.manager.is_participating()
        # the next step's rows, if the live groups stay the same: read while this one trains
        for a, b in step_rows(pos + self.rows_per_step, rank, participants, self.shards,
                              self.batch_size):
            self._reader.prefetch(*rank_part((a, b), self.group_rank, self.group_ranks))
        # one gradient all-reduce a step, after the last shard: Replicated.accumulate, whose
        # shards are those of self.rows
        for _, run in zip(r.accumulate(self.shards), self.rows):
            yield self._reader.read(*rank_part(run, self.group_rank, self.group_ranks))

    def close(self) -> None:
        self._reader.close()

"""Rank side: a model and optimizer under torchft's ``Manager``, one replica group per launch.

    from gpulaunch import ft, runtime as rt

    def train(steps):
        model = Net()
        r = ft.replicated(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        while r.step < steps:
            r.optimizer.zero_grad()            # starts this step's quorum
            x, y = batch(r.step, ft.replica_id())
            loss_fn(r.model(x), y).backward()  # gradients averaged across live replica groups
            r.optimizer.step()                 # applied only if every live group committed
        return r.summary()

Every replica group trains the same model; torchft's lighthouse forms a quorum of the live
groups at each step, and a group that joins late (a restarted one) receives the current weights
and optimizer state from a live peer at its first step (torchft's HTTP checkpoint transport),
not from a checkpoint on disk. A group is one rank (torchft's DDP), or several that shard
the model with FSDP2 (``shard=True``, HSDP: ``sharded.py``); the caller starts the groups with
:func:`gpulaunch.ft.run_replicas`, which also sets the variables read below.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from datetime import timedelta
from typing import Any

from ..errors import ConfigurationError

# set by the caller side (replicas.py) for every rank of a replica group
ENV_REPLICA = "GPULAUNCH_FT_REPLICA"
ENV_REPLICAS = "GPULAUNCH_FT_REPLICAS"
ENV_ATTEMPT = "GPULAUNCH_FT_ATTEMPT"
ENV_DIR = "GPULAUNCH_FT_DIR"
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"           # torchft's own name for it
ENV_HEAL_FROM = "GPULAUNCH_FT_HEAL_FROM"        # a restarted group must rejoin past this step
ENV_MIN = "GPULAUNCH_FT_MIN_REPLICAS"           # fewest groups a step needs (elastic: min)
ENV_FIRST = "GPULAUNCH_FT_FIRST_GROUPS"         # "0,1": the groups of the run's start


def replica_id() -> int:
    """This rank's replica group (0 .. num_replicas()-1); pick its data with it."""
    return int(os.environ.get(ENV_REPLICA, os.environ.get("REPLICA_GROUP_ID", "0")))


def num_replicas() -> int:
    """How many replica groups the run has at most (an elastic run: its ``max``; fewer may be
    alive at a step: ``Replicated.participants`` says how many are)."""
    return int(os.environ.get(ENV_REPLICAS, os.environ.get("NUM_REPLICA_GROUPS", "1")))


def attempt() -> int:
    """0 for a replica group's first start, 1 after its first restart, ..."""
    return int(os.environ.get(ENV_ATTEMPT, "0"))


class _Progress:
    """Appends one JSON line per committed step (group rank 0) to the run's ft folder, which
    the caller reads to say when a group failed, when it was back and what it missed."""

    def __init__(self, group_rank: int):
        folder = os.environ.get(ENV_DIR)
        self.path = None
        self.first = True
        if folder:
            stem = os.path.join(folder, f"replica{replica_id()}")
            with open(f"{stem}.attempt{attempt()}.rank{group_rank}.pid", "w") as f:
                f.write(str(os.getpid()))
            if group_rank == 0:
                self.path = f"{stem}.steps.jsonl"
        self.healed_to: int | None = None
        self._alone_since: float | None = None

    def quorum_without_peers(self, step: int, wait_s: float = 30.0) -> bool:
        """True when this group, started after the run reached step ``heal_from``, is at
        ``step`` before its first commit: its quorum had none of the live groups in it (a
        lighthouse that waited ``join_timeout_ms`` for them while a loaded host held them up
        forms a quorum of the newcomer alone, at step 0). Such a step must not commit; the
        next quorum will likely have the live groups. After ``wait_s`` of that, False: the
        commit goes ahead and :meth:`committed` stops the group (nobody to heal from)."""
        heal_from = int(os.environ.get(ENV_HEAL_FROM, "-1"))
        if not self.first or heal_from <= 0 or step >= heal_from:
            return False
        if self._alone_since is None:
            self._alone_since = time.monotonic()
        return time.monotonic() - self._alone_since < wait_s

    @staticmethod
    def wait_for_first_starts(timeout: float) -> None:
        """Before the first quorum of a run: wait until every replica group's process is up.
        Otherwise a group that starts seconds before another can train alone from step 0,
        even to the end, and the late one then trains alone from step 0 again: two models."""
        folder = os.environ.get(ENV_DIR)
        first = os.environ.get(ENV_FIRST)
        if not folder or attempt() > 0 or first == "":
            return                           # a replacement, or a group that grows the run
        deadline = time.monotonic() + timeout
        want = [int(i) for i in first.split(",")] if first else range(num_replicas())
        while time.monotonic() < deadline:
            names = os.listdir(folder)
            if all(any(n.startswith(f"replica{i}.attempt") and n.endswith(".pid") for n in names)
                   for i in want):
                return
            time.sleep(0.02)

    def committed(self, step: int, participants: int) -> None:
        # The first commit of a process whose step is past 1 received its state from a peer.
        if self.first and step > 1:
            self.healed_to = step - 1
        heal_from = int(os.environ.get(ENV_HEAL_FROM, "-1"))
        if self.first and heal_from > 0 and step <= heal_from:
            raise RuntimeError(
                f"replica group {replica_id()} was restarted after the run reached step "
                f"{heal_from}, but no live replica group was there to heal from (all failed or "
                "finished); it would have trained again from step 0. Resume such a run from a "
                "checkpoint (gpulaunch.parallel.resume).")
        if self.path is not None:
            rec = {"a": attempt(), "step": step, "t": round(time.time(), 4), "n": participants}
            if self.first and self.healed_to is not None:
                rec["healed_to"] = self.healed_to
            with open(self.path, "a") as f:        # one write per line
                f.write(json.dumps(rec) + "\n")
        self.first = False


def _optimizer_class():
    from torchft.optim import OptimizerWrapper

    class ReplicatedOptimizer(OptimizerWrapper):
        """torchft's optimizer wrapper that also records each committed step."""

        def __init__(self, manager, optim, progress: _Progress):
            super().__init__(manager, optim)
            self.progress = progress
            self.committed_steps = 0
            self.skipped_steps = 0

        def step(self, closure=None) -> bool:
            """Step the wrapped optimizer if every live replica group committed; returns
            whether it did (a step that lost a peer mid-way is dropped everywhere)."""
            if closure is not None:
                raise ConfigurationError("ft.replicated: optimizers that need a closure "
                                         "(LBFGS) are not supported")
            self.manager.wait_quorum()      # a healing group's step is the peers' after it
            if self.progress.quorum_without_peers(self.manager.current_step()):
                self.manager.report_error(RuntimeError(
                    "a late replica group's quorum had none of the live groups; not committed"))
            if not self.manager.should_commit():
                self.skipped_steps += 1
                return False
            self.optim.step()
            self.committed_steps += 1
            self.progress.committed(self.manager.current_step(),
                                    self.manager.num_participants())
            return True

    return ReplicatedOptimizer


def _ddp_class():
    import torch
    from torchft.ddp import DistributedDataParallel

    class ReplicatedDDP(DistributedDataParallel):
        """torchft's DDP with a gradient hook that survives a peer dying mid-all-reduce.

        torchft 0.2.0's own hook asserts on the future of a failed all-reduce and so crashes
        the surviving group too (fixed upstream after 0.2.0). Here a failed all-reduce hands
        the bucket back unchanged: the manager has recorded the error, so ``should_commit()``
        is False on every group and the step is dropped, as torchft intends."""

        @staticmethod
        def _comm_hook(state, bucket):
            work = state.allreduce(bucket.buffer())
            ok = work.wait()
            inner = getattr(work.get_future(), "_fut", None)
            if ok and inner is not None:
                return inner
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return ReplicatedDDP


@dataclasses.dataclass
class Replicated:
    """What :func:`replicated` returns: the wrapped ``model`` and ``optimizer`` (use them as
    the plain ones), torchft's ``manager``, and the step of the whole run (``step``)."""

    model: Any
    optimizer: Any
    manager: Any
    progress: _Progress

    @property
    def step(self) -> int:
        """Steps committed by the run so far (the same on every live group; a group that
        healed jumps to its peers' step)."""
        return self.manager.current_step()

    @property
    def data_rank(self) -> int:
        """This rank's data shard of the run's step: ``replica_id() * ranks per group + its
        rank in the group`` (each rank of a sharded group trains its own batch)."""
        import torch.distributed as dist
        return replica_id() * dist.get_world_size() + dist.get_rank()

    @property
    def data_size(self) -> int:
        """How many data shards a step of the full run has (every rank of every group)."""
        import torch.distributed as dist
        return num_replicas() * dist.get_world_size()

    @property
    def participants(self) -> int:
        """Replica groups taking part in this step (an elastic run's size now). Call it after
        ``optimizer.zero_grad()``, which starts the step's quorum (it waits for the quorum)."""
        return self.manager.num_participants()

    def shards(self, total: int | None = None) -> list[int]:
        """The data shards (``0 .. total-1``) this group trains on at this step, so that the
        step's global batch stays ``total`` shards whatever the number of live groups: its own
        when all ``total`` groups take part, the lost groups' spread over the live ones when
        fewer do (gradient accumulation). ``total`` defaults to :func:`num_replicas`.

        Loop over them with :meth:`accumulate` (one gradient all-reduce per step, as every
        group must make the same number). Call it after ``optimizer.zero_grad()`` (it waits
        for the step's quorum). A group that is healing at this step trains on shards too:
        torchft zeroes its gradient."""
        from .elastic import shards_for
        return shards_for(self.manager.participating_rank(), self.participants,
                          num_replicas() if total is None else total, first=self.step == 0)

    def accumulate(self, total: int | None = None):
        """:meth:`shards`, with the gradient all-reduce held back until the last one (DDP's
        ``no_sync``): the loop body runs one forward and backward per shard.

            r.optimizer.zero_grad()
            for shard in r.accumulate():
                x, y = batch(r.step, shard)
                (loss_fn(r.model(x), y) * r.shard_weight()).backward()
            r.optimizer.step()
        """
        shards = self.shards(total)
        for shard in shards[:-1]:
            with self.model.no_sync():
                yield shard
        yield shards[-1]

    def shard_weight(self, total: int | None = None) -> float:
        """What to scale each shard's loss by (``participants / total``): torchft averages the
        gradients over the live groups, so with this weight the step's gradient is the mean
        over all ``total`` shards, as with every group live, whatever the number of live
        groups."""
        total = num_replicas() if total is None else int(total)
        return max(1, self.participants) / total

    def loader(self, dataset, batch_size: int, *, shards: int | None = None,
               name: str = "train"):
        """This group's batches of a :class:`gpulaunch.data.StreamingDataset`, re-cut over the
        live replica groups at every step from one position the whole run shares (it travels
        to a healing group with the weights): each committed step trains the next ``shards x
        batch_size`` rows of the stream once, whatever groups come and go
        (:class:`~gpulaunch.ft.elastic_data.ElasticLoader`). Make it before the first step, in
        every group; iterate it once per step, after ``optimizer.zero_grad()``; scale each loss
        by its ``weight``. ``shards`` defaults to :func:`num_replicas`."""
        from .elastic_data import ElasticLoader
        return ElasticLoader(self, dataset, batch_size, name=name,
                             shards=num_replicas() if shards is None else shards)

    def summary(self) -> dict:
        """A small record to return from the function: replica, attempt, steps, healing."""
        return {"replica": replica_id(), "attempt": attempt(), "step": self.step,
                "committed_steps": self.optimizer.committed_steps,
                "skipped_steps": self.optimizer.skipped_steps,
                "healed_to": self.progress.healed_to,
                "batches_committed": self.manager.batches_committed()}

    def shutdown(self) -> None:
        """Stop the manager's servers (also done when the process ends)."""
        self.manager.shutdown(wait=False)


def replicated(model, optimizer, *, shard: bool = False, min_replicas: int | None = None,
               timeout: float = 10.0,
               quorum_timeout: float = 60.0, quorum_retries: int = 10,
               state: dict | None = None, lighthouse: str | None = None) -> Replicated:
    """Put ``model`` and ``optimizer`` under torchft's Manager for this replica group.

    Args:
        model: the plain ``nn.Module`` on this rank's device; every group builds the same one
            (the groups' step-0 weights are made equal by torchft before the first step).
        optimizer: a built optimizer over ``model.parameters()``; with ``shard=True`` also a
            factory ``lambda params: Optimizer(params, ...)`` (a built one is rebound to the
            sharded parameters, and must not have stepped yet).
        shard: HSDP: shard the model with FSDP2 over the ranks of this replica group
            (``run_replicas(ranks_per_group=K)``), replicate across groups with torchft. Needed
            when a group has more than one rank; with one it works too (nothing to shard).
        min_replicas: fewest live replica groups a step needs to commit; default the run's
            (``run_replicas(replicas=(min, max))``: ``min``; else 1).
        timeout: seconds for one cross-group all-reduce, commit vote or state transfer; a
            peer that vanished mid-step costs at most this.
        quorum_timeout: seconds a group waits for a quorum (a restarted group waits here for
            its peers' next step).
        quorum_retries: times a quorum request is retried when the lighthouse fails; torchft
            waits ``quorum_timeout / (quorum_retries + 1)`` before each retry (5.5 s by default),
            which is what a restarted lighthouse costs the groups.
        state: more objects with ``state_dict()`` / ``load_state_dict()`` (an lr scheduler, a
            data loader's position) sent with the weights to a healing group, by name.
        lighthouse: the lighthouse address; default ``$TORCHFT_LIGHTHOUSE`` (set by
            :func:`run_replicas`).
    """
    import torch.distributed as dist

    from .. import runtime as rt

    if min_replicas is None:
        min_replicas = int(os.environ.get(ENV_MIN, "1"))

    address = lighthouse or os.environ.get(ENV_LIGHTHOUSE)
    if not address:
        raise ConfigurationError(
            "ft.replicated() needs a torchft lighthouse: start the function with "
            "gpulaunch.ft.run_replicas(...) (it starts one), or pass lighthouse='http://host:port'.")
    for name, obj in (state or {}).items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigurationError(f"ft.replicated(state={{{name!r}: ...}}): a "
                                     f"{type(obj).__name__} has no state_dict()/load_state_dict()")
    try:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
    except ImportError as e:
        raise ConfigurationError(f"gpulaunch.ft needs torchft ({e}): pip install "
                                 "'gpulaunch[ft]'") from e
    from .sharded import (
        check_layout,
        load_local_state,
        local_state,
        shard_in_group,
        sharded_params,
    )

    rt.init()                                    # the group's own store and process group
    check_layout(dist.get_world_size(), shard)
    params = None                                # the sharded parameters, by name (HSDP)
    if shard:
        model, optimizer = shard_in_group(model, optimizer)
        params = sharded_params(model)
    device = next(model.parameters()).device
    pg_timeout = timedelta(seconds=timeout)
    pg = ProcessGroupNCCL(timeout=pg_timeout) if device.type == "cuda" \
        else ProcessGroupGloo(timeout=pg_timeout)
    extra = dict(state or {})

    def state_dict():
        # a sharded rank sends its own shards: the healing group's same rank takes them
        out = local_state(model, params, optimizer) if shard else \
            {"model": model.state_dict(), "optim": optimizer.state_dict()}
        out.update({name: obj.state_dict() for name, obj in extra.items()})
        return out

    def load_state_dict(sd):
        if shard:
            load_local_state(model, params, optimizer, sd)
        else:
            model.load_state_dict(sd["model"])
            optimizer.load_state_dict(sd["optim"])
        for name, obj in extra.items():
            obj.load_state_dict(sd[name])

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    manager = Manager(
        pg=pg, min_replica_size=min_replicas, load_state_dict=load_state_dict,
        state_dict=state_dict, replica_id=f"gpulaunch_replica_{replica_id()}",
        lighthouse_addr=address, timeout=pg_timeout,
        # rank 0 of the group talks to the lighthouse; every rank heals its own shards
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        quorum_timeout=timedelta(seconds=quorum_timeout), quorum_retries=quorum_retries,
        connect_timeout=timedelta(seconds=max(timeout, 10.0)),
        # advertise an address the peers can reach: loopback on one host
        **({"hostname": "127.0.0.1"} if host in ("127.0.0.1", "localhost", "::1") else {}))
    progress = _Progress(group_rank=dist.get_rank())
    progress.wait_for_first_starts(quorum_timeout)
    if shard:
        from .sharded import sharded_replica
        wrapped = sharded_replica(manager, model)
    else:
        wrapped = _ddp_class()(manager, model)
    opt = _optimizer_class()(manager, optimizer, progress)
    return Replicated(model=wrapped, optimizer=opt, manager=manager, progress=progress)

"""``gpulaunch.ft``: per-step fault tolerance on torchft (``pip install 'gpulaunch[ft]'``).

Replica groups train the same model; when one fails, the others keep stepping, gpulaunch
launches the failed group again, and it takes the current weights and optimizer state from a
live peer at its first step (no checkpoint reload). torchft's lighthouse forms each step's
quorum; gpulaunch starts and supervises it.

    from gpulaunch import ft

    def train(steps):
        model = Net()
        r = ft.replicated(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        while r.step < steps:
            r.optimizer.zero_grad()
            x, y = batch(r.step, ft.replica_id())
            loss_fn(r.model(x), y).backward()
            r.optimizer.step()
        return r.summary()

    result = ft.run_replicas(train, 200, replicas=3)
    print(result.summary())        # which groups failed, when, how many steps each missed

HSDP: ``run_replicas(..., ranks_per_group=K)`` makes each group K ranks, and
``ft.replicated(model, opt, shard=True)`` shards the model with FSDP2 inside the group while
torchft replicates each shard across groups (``sharded.py``); a rank that dies takes its whole
group down, which is replaced as one and heals shard by shard.

An elastic run (``replicas=(1, 2)``, ``node_lost_timeout=``, ``capacity=ft.Capacity(2)``) goes
on with fewer groups when a lost one is not replaced in time, and grows back when capacity
returns (``r.shards()`` keeps the global batch); ``result.size_changes`` lists each change.
``r.loader(dataset, batch_size=...)`` re-cuts a ``gpulaunch.data.StreamingDataset`` over the
live groups at every step, each committed row of the stream trained once across the changes.

See docs/fault-tolerance.md.
"""

from ..common.replica_spec import Replicas
from .elastic import Capacity, ReplicasBelowMinError, SizeChange
from .elastic_data import ElasticLoader
from .lighthouse import Lighthouse, LighthouseError
from .replicas import ReplicaGroups
from .replicated import Replicated, attempt, num_replicas, replica_id, replicated
from .result import ReplicaFailure, ReplicasResult, group_pids, read_steps
from .run import run_replicas

__all__ = ["Capacity", "ElasticLoader", "Lighthouse", "LighthouseError", "ReplicaFailure",
           "ReplicaGroups", "Replicas", "ReplicasBelowMinError", "ReplicasResult", "Replicated",
           "SizeChange", "attempt", "group_pids", "num_replicas", "read_steps", "replica_id",
           "replicated",
           "run_replicas"]

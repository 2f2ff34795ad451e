"""``gpulaunch.parallel.zero_waits.event_waits`` on a GPU: ZeRO-3 at one rank (nothing sharded)
waits for its parameters with CUDA events instead of a host sync per fetched module, and trains
exactly as before.

Two cold launches of one process each (the patch is process-wide): DeepSpeed's ZeRO-3 engine
over the package's reference model, each block one ZeRO-3 unit as ``prepare()`` and the recipes
make them, bf16, the same data; one with DeepSpeed's own waits, one after ``event_waits()``.
The losses must be equal bit for bit (the same kernels run in the same order; only where the
host waits changes), and the host syncs inside one profiled forward and backward must drop: with
DeepSpeed's waits there is at least one per block.
"""

from __future__ import annotations

import pytest

from .helpers import require

pytestmark = pytest.mark.gpu
CFG = {"vocab_size": 256, "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
       "ffn_dim": 512, "max_seq_len": 64}
STEPS = 6
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def zero3_run(events: bool) -> dict:
    import deepspeed
    import torch
    from deepspeed.utils import set_z3_leaf_modules
    from torch.profiler import ProfilerActivity, profile

    from gpulaunch import runtime as rt
    from gpulaunch.parallel.reference_model import Llama, LlamaConfig
    from gpulaunch.parallel.zero import deepspeed_config
    from gpulaunch.parallel.zero_waits import event_waits
    dev = rt.init()
    deepspeed.init_distributed(dist_backend="nccl")
    patched = event_waits() if events else False
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG)).to(dev)
    for block in model.layers:
        set_z3_leaf_modules(block, [type(block)])
    # persistence 0: every weight partitioned and fetched (this model's matrices are below the
    # default threshold, and a persistent weight is never waited for)
    cfg = deepspeed_config(3, mixed_precision="bf16", micro_batch_size=8,
                           block_numel=sum(p.numel() for p in model.layers[0].parameters()),
                           overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    engine, *_ = deepspeed.initialize(model=model, config=cfg, dist_init_required=False,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG["vocab_size"], (8, 65), generator=g).to(dev)
    losses, syncs = [], None
    for step in range(STEPS):
        if step == STEPS - 1:       # the last forward and backward under the profiler
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                loss = engine(x[:, :-1], x[:, 1:])
                engine.backward(loss)
                torch.cuda.synchronize()
            syncs = sum(e.name in SYNCS for e in prof.events())
        else:
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().item())
    return {"patched": patched, "losses": losses, "syncs": syncs, "blocks": len(model.layers)}


@pytest.mark.timeout(240)
def test_zero3_at_one_rank_waits_with_events_and_trains_the_same(gpu, record):
    require("deepspeed", "deepspeed (built from its sdist by scripts/gpu_wheels.sh)", load=False)
    from gpulaunch import distributed
    job = distributed(gpus=1, timeout=150, stream_logs="rank0")
    own = job(zero3_run).distributed(False)[0]
    ours = job(zero3_run).distributed(True)[0]
    record(own_syncs=own["syncs"], event_syncs=ours["syncs"], losses=ours["losses"])
    assert own["patched"] is False and ours["patched"] is True
    assert ours["losses"] == own["losses"], (own["losses"], ours["losses"])
    assert ours["losses"][-1] < ours["losses"][0]
    # DeepSpeed's own waits: a host sync per fetched block, forward and backward
    assert own["syncs"] >= own["blocks"], own
    assert ours["syncs"] <= own["syncs"] - own["blocks"], (own, ours)

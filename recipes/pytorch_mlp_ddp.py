# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # PyTorch DDP: a simple MLP
#
# The seed's first example: an MLP (10 → 64 → 64 → 1, ReLU and dropout 0.2) trained with
# `DistributedDataParallel`, a `DistributedSampler`, Adam (lr 1e-3) and MSE. The seed regresses
# on pure noise, which nothing can learn; here the target is a fixed random function of the
# input plus a little noise, so the held-out loss has somewhere to fall.
#
# What it shows: one process per GPU (2 CPU workers without one), each rank reading a disjoint
# slice of the data, gradients averaged by DDP, the loss tracked per step and all-reduced.
#
# Run it: `python recipes/pytorch_mlp_ddp.py` (tiny, CPU, ~1 min) or `--full` (the seed's
# sizes: 5000 samples, 3 epochs, 8 GPUs). Any setting can be overridden (`--epochs 5`).

# %% tags=["parameters"]
import argparse
import dataclasses
import json
import os
import sys
import typing
from typing import Optional


@dataclasses.dataclass
class Config:
    gpus: Optional[int] = None       # ranks; None: every GPU here (2 CPU workers without one)
    samples: int = 4000              # training samples (a held-out set of 1000 more)
    epochs: int = 3
    batch_size: int = 32             # per rank: global batch = batch_size * world size
    lr: float = 1e-3
    dropout: float = 0.2
    seed: int = 0
    log_every: int = 20              # steps between printed (and MLflow-logged) losses
    mlflow_uri: Optional[str] = None  # e.g. sqlite:///mlflow.db; also picks up MLFLOW_RUN_ID
    out: Optional[str] = None        # write the result dict here as JSON
    cluster: Optional[str] = None    # a Ray address ("auto", "head:6379"): run on that cluster's
                                     # nodes, gpus= then counts ranks over all of them


# The seed trains 5000 samples for 3 epochs at batch size 1 per GPU on 8 GPUs; batch 1 only
# measures kernel-launch latency, so the full preset keeps the data and epochs and uses 32.
FULL = dict(samples=5000, epochs=3, batch_size=32)


def config_from_argv(argv=None) -> Config:
    """Defaults (tiny) or --full, then any --field VALUE on top."""
    parser = argparse.ArgumentParser(description="PyTorch DDP: a simple MLP")
    parser.add_argument("--full", action="store_true", help=f"the seed's sizes: {FULL}")
    for f in dataclasses.fields(Config):
        tp = typing.get_type_hints(Config)[f.name]
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=tp, default=None)
    args = vars(parser.parse_args(argv))
    cfg = Config(**FULL) if args.pop("full") else Config()
    return dataclasses.replace(cfg, **{k: v for k, v in args.items() if v is not None})


# in a notebook, edit the Config defaults above instead of passing flags
cfg = config_from_argv([] if "ipykernel" in sys.modules else None)
print(cfg)

# %% [markdown]
# ## Data and model
# Every rank builds the same dataset from the same seed (the data is generated, never
# downloaded); the `DistributedSampler` then hands each rank its own slice.

# %%
import torch
from torch import nn


def teacher(x):
    """The function to learn: fixed random weights (the same for every split and rank),
    scaled so that y has variance ~1 over x ~ N(0, I)."""
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(10, 16, generator=g), torch.randn(16, 1, generator=g)
    scale = (torch.tanh(torch.randn(4096, 10, generator=g) @ w1) @ w2).std()
    return torch.tanh(x @ w1) @ w2 / scale


def make_data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = teacher(x) + 0.05 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class SimpleMLP(nn.Module):
    def __init__(self, input_dim=10, hidden_dim=64, output_dim=1, dropout=0.2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden_dim, output_dim))

    def forward(self, x):
        return self.net(x)


# %% [markdown]
# ## MLflow, when asked for
# Rank 0 logs to MLflow if `mlflow_uri` is set or a launcher already opened a run for us
# (`MLFLOW_RUN_ID`); without mlflow installed it prints a note and goes on.

# %%
def start_mlflow(cfg, run_name: str):
    import os
    if not (cfg.mlflow_uri or os.environ.get("MLFLOW_RUN_ID")):
        return None
    try:
        import mlflow
    except ImportError:
        print("note: mlflow is not installed; metrics are only printed and returned")
        return None
    # gpulaunch's tracking opened this call's run (MLFLOW_RUN_ID, in its store): log there. To
    # log elsewhere, point gpulaunch at that store (MLFLOW_TRACKING_URI in the caller).
    if cfg.mlflow_uri and not os.environ.get("MLFLOW_RUN_ID"):
        mlflow.set_tracking_uri(cfg.mlflow_uri)
    if not os.environ.get("MLFLOW_RUN_ID"):
        mlflow.set_experiment("gpulaunch-recipes")
    mlflow.start_run(run_name=run_name)  # resumes MLFLOW_RUN_ID when it is set
    mlflow.log_params(dataclasses.asdict(cfg))
    return mlflow


# %% [markdown]
# ## The training function
# Everything inside runs once per rank. `rt.init()` creates the process group (NCCL on GPUs,
# gloo on CPU) and returns this rank's device.

# %%
from gpulaunch import distributed
from gpulaunch import runtime as rt


@distributed(gpus=cfg.gpus, cluster=cfg.cluster)
def train(cfg: Config) -> Optional[dict]:
    import resource
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    device = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts)

    train_set, eval_set = make_data(cfg.samples, cfg.seed), make_data(1000, cfg.seed + 1)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)

    model = SimpleMLP(dropout=cfg.dropout).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    loss_fn = nn.MSELoss()
    tracker = start_mlflow(cfg, "pytorch_mlp_ddp") if rank == 0 else None

    @torch.no_grad()
    def eval_loss() -> float:
        # every rank scores the whole (small) held-out set; no dropout in eval mode
        model.eval()
        x, y = eval_set.tensors
        loss = loss_fn(model.module(x.to(device)), y.to(device)).item()
        model.train()
        return loss

    before = eval_loss()
    rt.print0(f"held-out MSE before training: {before:.4f}  ({world} ranks, {device.type})")
    history, step, t0 = [], 0, time.perf_counter()
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for x, y in loader:
            loss = loss_fn(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            opt.step()
            step += 1
            if step % cfg.log_every == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg)  # the mean over ranks, for logging only
                avg = avg.item() / world
                history.append((step, avg))
                rt.print0(f"epoch {epoch} step {step:4d}  train loss {avg:.4f}")
                if tracker:
                    tracker.log_metric("loss", avg, step=step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = eval_loss()
    rt.print0(f"held-out MSE after training:  {after:.4f}  ({after / before:.1%} of the start)")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if tracker:
        tracker.log_metrics({"eval_mse_before": before, "eval_mse_after": after})
        if not os.environ.get("MLFLOW_RUN_ID"):  # gpulaunch ends its own run with the outcome
            tracker.end_run()
    if rank != 0:
        return None
    return {"recipe": "pytorch_mlp_ddp", "world_size": world, "device": device.type,
            "metric": "eval_mse", "before": before, "after": after, "steps": step,
            "loss_history": history, "train_seconds": seconds,
            "samples_per_s": step * cfg.batch_size * world / seconds,
            "peak_mem_gib": peak, "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda"
            else "cpu_max_rss"}


# %% [markdown]
# ## Run it
# `.distributed()` returns one entry per rank; rank 0 returns the result.

# %%
result = train.distributed(cfg)[0]
print(f"\nheld-out MSE {result['before']:.4f} -> {result['after']:.4f} in {result['steps']} steps "
      f"on {result['world_size']} {result['device']} rank(s), "
      f"{result['samples_per_s']:.0f} samples/s, peak {result['peak_mem_gib']:.2f} GiB")
if cfg.out:
    with open(cfg.out, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), **result}, f, indent=2)

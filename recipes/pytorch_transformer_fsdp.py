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
# # PyTorch FSDP2: the seed's "10M-parameter" transformer, with checkpoints that resume
#
# The seed's transformer classifier: dimension 512, 4 blocks, 8 attention heads, MLP ratio 4
# (12.9M parameters; the exact count is printed), trained with AdamW (lr 1e-3, wd 0.01) and
# cross-entropy. Each block is sharded with FSDP2's `fully_shard`, then the whole model.
#
# Every `ckpt_every` steps all ranks write one sharded Distributed Checkpoint (DCP) to a local
# folder or an fsspec URL. Run the recipe again with the same `ckpt_dir` and it resumes from the
# newest complete checkpoint: model, optimizer, step, data position and RNG.
#
# The seed's data are random features with random labels (nothing to learn). Here each
# sequence carries its class's prototype vector at one random position, hidden in noise, so
# the model must attend to find it, and the loss falls from ln(10) = 2.30.
#
# Run it: `python recipes/pytorch_transformer_fsdp.py` (tiny, CPU) or `--full` (the seed's
# 10,000 samples, batch 32 per GPU, 5 epochs).

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
    dim: int = 512
    blocks: int = 4
    heads: int = 8
    mlp_ratio: int = 4
    num_classes: int = 10
    seq_len: int = 8                 # vectors per sequence
    samples: int = 2048              # training sequences (and 512 held out)
    batch_size: int = 8              # per rank
    steps: int = 40                  # total optimizer steps (a resumed run continues to this)
    lr: float = 1e-3
    weight_decay: float = 0.01
    strategy: str = "fsdp"           # gpulaunch.parallel.prepare(): "fsdp", "ddp", ...
    mixed_precision: Optional[str] = None  # None (fp32, as the seed) or "bf16"
    ckpt_dir: str = "checkpoints/pytorch_transformer_fsdp"  # a path or an fsspec URL
    ckpt_every: int = 20             # steps between checkpoints (the seed: 10)
    keep: int = 2                    # complete checkpoints kept
    log_every: int = 10
    seed: int = 0
    mlflow_uri: Optional[str] = None  # e.g. sqlite:///mlflow.db; also picks up MLFLOW_RUN_ID
    out: Optional[str] = None        # write the result dict here as JSON


# The seed: 10,000 samples, batch 32 per GPU on 8 GPUs, 5 epochs (~195 steps there). On fewer
# GPUs the same epochs take more steps. Its checkpoint every 10 batches is kept at 100 here so
# a 1-GPU run does not spend its time writing 150 MB checkpoints.
FULL = dict(samples=10_000, seq_len=64, batch_size=32, steps=1500, ckpt_every=100, log_every=50)


def config_from_argv(argv=None) -> Config:
    """Defaults (tiny) or --full, then any --field VALUE on top."""
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 transformer with DCP resume")
    parser.add_argument("--full", action="store_true", help=f"the seed's sizes: {FULL}")
    for f in dataclasses.fields(Config):
        tp = typing.get_type_hints(Config)[f.name]
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=tp, default=None)
    args = vars(parser.parse_args(argv))
    cfg = Config(**FULL) if args.pop("full") else Config()
    cfg = dataclasses.replace(cfg, **{k: v for k, v in args.items() if v is not None})
    if "://" not in cfg.ckpt_dir:  # ranks may not share the caller's working directory
        cfg.ckpt_dir = os.path.abspath(cfg.ckpt_dir)
    return cfg


cfg = config_from_argv([] if "ipykernel" in sys.modules else None)
print(cfg)

# %% [markdown]
# ## Model
# `nn.MultiheadAttention` with pre-norm residual blocks; mean-pooled, then a linear head.
# The blocks sit in an `nn.ModuleList`, which is how `prepare()` finds the units to shard.

# %%
import torch
from torch import nn


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(),
                                 nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class SimpleTransformer(nn.Module):
    def __init__(self, input_dim=512, num_layers=4, num_classes=10, heads=8, mlp_ratio=4):
        super().__init__()
        self.embed = nn.Linear(input_dim, input_dim)
        self.blocks = nn.ModuleList(TransformerBlock(input_dim, heads, mlp_ratio)
                                    for _ in range(num_layers))
        self.norm = nn.LayerNorm(input_dim)
        self.head = nn.Linear(input_dim, num_classes)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


# %% [markdown]
# ## Data
# Generated from a seed on every rank (no download): class `c`'s prototype is added at one
# random position of a noise sequence. Each rank draws its own batches from its slice.

# %%
class PrototypeSequences(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, dim: int, num_classes: int, seed: int):
        protos = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(99))
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(num_classes, (n,), generator=g)
        self.x = torch.randn(n, seq_len, dim, generator=g)
        where = torch.randint(seq_len, (n,), generator=g)
        self.x[torch.arange(n), where] += 1.5 * protos[self.y]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


# %% [markdown]
# ## MLflow, when asked for (rank 0; a note and no MLflow when it is not installed)

# %%
def start_mlflow(cfg, run_name: str):
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
# `prepare(strategy="fsdp")` does what the seed's `apply_fsdp` does by hand:
#
# ```python
# for block in model.blocks:
#     fully_shard(block)        # each block's parameters become DTensor shards
# fully_shard(model)            # the rest (embedding, norm, head)
# optimizer = AdamW(model.parameters(), ...)   # built on the sharded parameters
# ```
#
# `save_checkpoint` writes `{model, optimizer}` with `torch.distributed.checkpoint` (each rank
# its own shards, no gather), plus step, data position and per-rank RNG, and publishes the
# folder atomically (a crash mid-save leaves the previous checkpoint the newest).
# `load_checkpoint` restores all of it into the sharded model.
# The same resume in one line, data position included: build the loader with
# `distributed_loader`, then `step = resume(cfg.ckpt_dir, p, loader=loader)` (0 on a fresh start)
# and `save_checkpoint(..., loader=loader)`; the loader then skips the batches already trained
# on by itself (docs/reliability.md, "Resume in one line"). This recipe keeps its explicit
# version below, to show what that does.

# %%
from gpulaunch import distributed
from gpulaunch import runtime as rt
from gpulaunch.parallel import latest_checkpoint, load_checkpoint, prepare, save_checkpoint


@distributed(gpus=cfg.gpus)
def train(cfg: Config) -> Optional[dict]:
    import resource
    import time

    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    device = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # fp32 weights, TF32 tensor-core matmuls
    torch.manual_seed(cfg.seed)

    model = SimpleTransformer(cfg.dim, cfg.blocks, cfg.num_classes, cfg.heads, cfg.mlp_ratio)
    n_params = sum(p.numel() for p in model.parameters())
    rt.print0(f"model: {n_params:,} parameters ({n_params / 1e6:.1f}M), {cfg.blocks} blocks")
    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=cfg.weight_decay),
                strategy=cfg.strategy, mixed_precision=cfg.mixed_precision)
    local = sum((q.to_local() if hasattr(q, "to_local") else q).numel() for q in model.parameters())
    if cfg.strategy == "fsdp":
        rt.print0(f"FSDP2: {len(model.blocks)} blocks + the root sharded over {world} ranks; "
                  f"rank 0 holds {local:,} of the {n_params:,} parameters")

    train_set = PrototypeSequences(cfg.samples, cfg.seq_len, cfg.dim, cfg.num_classes, cfg.seed)
    eval_set = PrototypeSequences(512, cfg.seq_len, cfg.dim, cfg.num_classes, cfg.seed + 1)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=cfg.seed,
                                 drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=True)
    eval_loader = DataLoader(eval_set, batch_size=64,
                             sampler=DistributedSampler(eval_set, world, rank, shuffle=False))
    steps_per_epoch = len(loader)
    loss_fn = nn.CrossEntropyLoss()

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        """Held-out loss and accuracy, summed over every rank's slice."""
        p.model.eval()
        tot = torch.zeros(3, device=device)
        for x, y in eval_loader:
            x, y = x.to(device), y.to(device)
            logits = p.model(x).float()
            tot += torch.stack([loss_fn(logits, y) * len(y), (logits.argmax(-1) == y).sum(),
                                torch.tensor(len(y), device=device)])
        dist.all_reduce(tot)
        p.model.train()
        return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()

    # Resume: every rank asks for the newest complete checkpoint under ckpt_dir.
    start, resumed_from = 0, None
    if latest_checkpoint(cfg.ckpt_dir) is not None:
        info = load_checkpoint(cfg.ckpt_dir, p)
        start = resumed_from = info["step"]
        rt.print0(f"resumed from {info['path']} (step {start})")
        if start >= cfg.steps:
            rt.print0(f"already at step {start} >= steps={cfg.steps}: raise --steps to train on")
    else:
        rt.print0(f"no checkpoint under {cfg.ckpt_dir}: starting from scratch")
    before_loss, before_acc = evaluate()
    rt.print0(f"held-out loss {before_loss:.4f}, accuracy {before_acc:.1%} at step {start}")

    tracker = start_mlflow(cfg, "pytorch_transformer_fsdp") if rank == 0 else None
    history, saved, step = [], [], start
    t0 = time.perf_counter()
    while step < cfg.steps:
        epoch, skip = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)  # the same order as an uninterrupted run
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue  # already trained on before the checkpoint
            loss = loss_fn(p.model(x.to(device)).float(), y.to(device))
            p.backward(loss)  # FSDP2 reduce-scatters the gradients into each rank's shard
            p.step()
            p.zero_grad()
            step += 1
            if step % cfg.log_every == 0 or step == cfg.steps:
                avg = loss.detach().clone()
                dist.all_reduce(avg)
                history.append((step, avg.item() / world))
                rt.print0(f"step {step:5d}  epoch {epoch}  train loss {history[-1][1]:.4f}")
                if tracker:
                    tracker.log_metric("loss", history[-1][1], step=step)
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                saved.append(save_checkpoint(cfg.ckpt_dir, p, step=step, keep=cfg.keep,
                                             extra={"epoch": epoch}))
                rt.print0(f"step {step:5d}  checkpoint -> {saved[-1]}")
            if step >= cfg.steps:
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after_loss, after_acc = evaluate()
    rt.print0(f"held-out loss {before_loss:.4f} -> {after_loss:.4f}, "
              f"accuracy {before_acc:.1%} -> {after_acc:.1%} (steps {start} -> {step})")
    if tracker:
        tracker.log_metrics({"eval_loss": after_loss, "eval_accuracy": after_acc}, step=step)
        if not os.environ.get("MLFLOW_RUN_ID"):  # gpulaunch ends its own run with the outcome
            tracker.end_run()
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    trained = step - start
    if rank != 0:
        return None
    return {"recipe": "pytorch_transformer_fsdp", "world_size": world, "device": device.type,
            "strategy": cfg.strategy, "parameters": n_params, "params_on_rank0": local,
            "metric": "eval_loss",
            "before": before_loss, "after": after_loss, "accuracy_before": before_acc,
            "accuracy_after": after_acc, "start_step": start, "resumed_from": resumed_from,
            "final_step": step, "loss_history": history, "checkpoints": saved,
            "train_seconds": seconds,
            "samples_per_s": trained * cfg.batch_size * world / seconds if trained else None,
            "tokens_per_s": trained * cfg.batch_size * world * cfg.seq_len / seconds
            if trained else None,
            "peak_mem_gib": peak,
            "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss"}


# %% [markdown]
# ## Run it
# Run this cell twice: the second run finds the checkpoint and continues from its step
# (raise `cfg.steps` to train further).

# %%
result = train.distributed(cfg)[0]
print(f"\n{result['parameters']:,} parameters; held-out loss {result['before']:.4f} -> "
      f"{result['after']:.4f}, accuracy {result['accuracy_before']:.1%} -> "
      f"{result['accuracy_after']:.1%}; steps {result['start_step']} -> {result['final_step']}"
      + (f"; {result['samples_per_s']:.0f} samples/s" if result["samples_per_s"] else "")
      + f"; peak {result['peak_mem_gib']:.2f} GiB")
if cfg.out:
    with open(cfg.out, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), **result}, f, indent=2)

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
# # Lightning + DDP: a two-tower recommender
#
# The seed's recommender: a user tower and an item tower (embedding tables feeding small MLPs),
# a dot product of their outputs as the logit, binary cross-entropy, AUROC, trained by a
# Lightning `Trainer(strategy="ddp")`, with `ModelCheckpoint` on validation AUROC and an
# `MLFlowLogger`. Embeddings come from TorchRec's `EmbeddingBagCollection` when TorchRec is
# installed, from `nn.EmbeddingBag` otherwise.
#
# gpulaunch starts one process per GPU and gives each the torchrun environment; Lightning
# recognises that external launch and does not start processes of its own (the recipe checks).
#
# Data: a ratings CSV (`userId,movieId,rating`, like the seed's GroupLens `item_ratings.csv`);
# by default the recipe writes a synthetic one where ratings come from hidden user and item
# factors, so there is structure to learn. As in the seed: ids are label-encoded, the label is
# rating >= mean, and the rows are split 70/21/9 into train/validation/test. The splits are
# written once as Parquet tables and every rank streams its own rows of them through
# `gpulaunch.data` (`StreamingDataset` + `StreamingLoader`: row-sharded, reshuffled per epoch).
#
# Run it: `python recipes/lightning_two_tower_ddp.py` (tiny, CPU) or `--full` (the seed's
# sizes: 100,000 ratings, embedding 128, towers [128, 64], batch 1024, lr 0.01).

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
    ratings_csv: Optional[str] = None  # your userId,movieId,rating CSV; None: generate one
    data_root: str = "data"          # where the generated CSV is written (once, then reused)
    users: int = 300                 # generated data: users, items, ratings, hidden factors
    items: int = 150
    ratings: int = 30_000
    factors: int = 4
    max_rows: int = 100_000          # the seed keeps the first 100,000 rows
    embedding_dim: int = 32
    layer_sizes: str = "32,16"       # tower MLP widths (the seed: 128,64)
    embeddings: str = "auto"         # "torchrec", "nn" (nn.EmbeddingBag) or "auto"
    epochs: int = 4
    batch_size: int = 256            # per rank
    lr: float = 0.01
    seed: int = 0
    ckpt_dir: str = "checkpoints/lightning_two_tower"
    mlflow_uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db; "": off
    experiment: str = "gpulaunch-recipes"
    out: Optional[str] = None        # write the result dict here as JSON


FULL = dict(users=1000, items=500, ratings=100_000, embedding_dim=128, layer_sizes="128,64",
            epochs=5, batch_size=1024)


def config_from_argv(argv=None) -> Config:
    """Defaults (tiny) or --full, then any --field VALUE on top."""
    parser = argparse.ArgumentParser(description="Lightning DDP two-tower recommender")
    parser.add_argument("--full", action="store_true", help=f"the seed's sizes: {FULL}")
    for f in dataclasses.fields(Config):
        tp = typing.get_type_hints(Config)[f.name]
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=tp, default=None)
    args = vars(parser.parse_args(argv))
    cfg = Config(**FULL) if args.pop("full") else Config()
    cfg = dataclasses.replace(cfg, **{k: v for k, v in args.items() if v is not None})
    cfg.ckpt_dir = os.path.abspath(cfg.ckpt_dir)  # the ranks resolve paths on their own
    if cfg.mlflow_uri is None:  # a store the user (or a launcher) configured, else a local file
        cfg.mlflow_uri = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    if cfg.mlflow_uri and cfg.mlflow_uri.startswith("sqlite:///") \
            and not cfg.mlflow_uri.startswith("sqlite:////"):
        cfg.mlflow_uri = "sqlite:///" + os.path.abspath(cfg.mlflow_uri[len("sqlite:///"):])
    return cfg


cfg = config_from_argv([] if "ipykernel" in sys.modules else None)
print(cfg)

# %% [markdown]
# ## A ratings CSV with hidden structure
# rating = 3 + 1.5 (u . v) + user bias + item bias + noise, rounded into 1..5, where u and v
# are hidden factor vectors. The towers never see u or v, only ids and labels.

# %%
import numpy as np
import pandas as pd


def write_synthetic_ratings(path: str, users: int, items: int, n: int, factors: int,
                            seed: int) -> str:
    if os.path.exists(path):
        return path
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(users, factors)) / np.sqrt(factors)
    v = rng.normal(size=(items, factors))
    user = rng.integers(users, size=n)
    item = rng.integers(items, size=n)
    score = (3 + 1.5 * (u[user] * v[item]).sum(1) + rng.normal(0, 0.4, users)[user]
             + rng.normal(0, 0.4, items)[item] + rng.normal(0, 0.5, n))
    df = pd.DataFrame({"userId": user + 1000, "movieId": item + 50_000,
                       "rating": np.clip(np.round(score), 1, 5)})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    df.to_csv(tmp, index=False)
    os.replace(tmp, path)  # a half-written file is never mistaken for the dataset
    return path


if cfg.ratings_csv is None:
    cfg.ratings_csv = os.path.abspath(os.path.join(
        cfg.data_root, f"ratings-{cfg.users}u-{cfg.items}i-{cfg.ratings}-s{cfg.seed}.csv"))
    write_synthetic_ratings(cfg.ratings_csv, cfg.users, cfg.items, cfg.ratings, cfg.factors,
                            cfg.seed)
cfg.ratings_csv = os.path.abspath(cfg.ratings_csv)
print("ratings:", cfg.ratings_csv)


def load_ratings(path: str, max_rows: int, seed: int):
    """Label-encoded ids, label = rating >= mean, split 70/21/9 (a fixed shuffle)."""
    df = pd.read_csv(path, nrows=max_rows)
    missing = {"userId", "movieId", "rating"} - set(df.columns)
    if missing:
        raise ValueError(f"{path} lacks the column(s) {sorted(missing)}; "
                         f"it has {list(df.columns)}")
    users = df["userId"].astype("category").cat.codes.to_numpy()
    items = df["movieId"].astype("category").cat.codes.to_numpy()
    labels = (df["rating"] >= df["rating"].mean()).to_numpy(np.float32)
    order = np.random.default_rng(seed).permutation(len(df))
    cut1, cut2 = int(0.7 * len(df)), int(0.91 * len(df))
    parts = [order[:cut1], order[cut1:cut2], order[cut2:]]
    return (int(users.max()) + 1, int(items.max()) + 1,
            [(users[p], items[p], labels[p]) for p in parts])


def write_splits(cfg) -> dict:
    """The train/validation/test splits as Parquet tables (`user`, `item`, `label`), written
    once before the ranks start; returns their paths and the id counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n_users, n_items, splits = load_ratings(cfg.ratings_csv, cfg.max_rows, cfg.seed)
    folder = os.path.splitext(cfg.ratings_csv)[0] + f"-splits-{cfg.max_rows}-s{cfg.seed}"
    paths = {}
    for name, (u, i, y) in zip(("train", "val", "test"), splits):
        paths[name] = os.path.join(folder, f"{name}.parquet")
        if not os.path.exists(paths[name]):
            os.makedirs(folder, exist_ok=True)
            tmp = f"{paths[name]}.tmp-{os.getpid()}"
            pq.write_table(pa.table({"user": u.astype(np.int64), "item": i.astype(np.int64),
                                     "label": y}), tmp, row_group_size=4096)
            os.replace(tmp, paths[name])
    return {"n_users": n_users, "n_items": n_items, **paths}


data = write_splits(cfg)
print("splits:", {k: v for k, v in data.items() if k.startswith("n_")}, os.path.dirname(data["train"]))


# %% [markdown]
# ## The model
# Each tower: an embedding table, then an MLP. The last layer has no ReLU (TorchRec's `MLP`
# puts one after every layer, which would force every dot product, hence every logit, >= 0).

# %%
import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification import BinaryAUROC


def tower(dim: int, sizes: list) -> nn.Sequential:
    layers, prev = [], dim
    for i, width in enumerate(sizes):
        layers.append(nn.Linear(prev, width))
        if i < len(sizes) - 1:
            layers.append(nn.ReLU())
        prev = width
    return nn.Sequential(*layers)


def have_torchrec() -> bool:
    try:
        import torchrec  # noqa: F401
        return True
    except Exception:  # ImportError, or an fbgemm build that does not match this torch
        return False


class Embeddings(nn.Module):
    """One table for users, one for items: TorchRec's EmbeddingBagCollection or nn.EmbeddingBag."""

    def __init__(self, n_users: int, n_items: int, dim: int, backend: str):
        super().__init__()
        self.backend = backend
        if backend == "torchrec":
            from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=n_users,
                                   feature_names=["user"]),
                EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=n_items,
                                   feature_names=["item"])], device=torch.device("cpu"))
        else:
            self.user = nn.EmbeddingBag(n_users, dim, mode="sum")
            self.item = nn.EmbeddingBag(n_items, dim, mode="sum")

    def forward(self, users, items):
        if self.backend == "torchrec":
            from torchrec import KeyedJaggedTensor
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=["user", "item"], values=torch.cat([users, items]),
                lengths=torch.ones(2 * len(users), dtype=torch.int32, device=users.device))
            out = self.ebc(kjt)
            return out["user"], out["item"]
        return self.user(users.view(-1, 1)), self.item(items.view(-1, 1))  # one id per bag


class TwoTower(pl.LightningModule):
    def __init__(self, n_users: int, n_items: int, embedding_dim: int, layer_sizes: list,
                 lr: float, embeddings: str):
        super().__init__()
        self.save_hyperparameters()
        self.embeddings = Embeddings(n_users, n_items, embedding_dim, embeddings)
        self.user_tower = tower(embedding_dim, layer_sizes)
        self.item_tower = tower(embedding_dim, layer_sizes)
        self.loss = nn.BCEWithLogitsLoss()
        self.val_auroc, self.test_auroc = BinaryAUROC(), BinaryAUROC()

    def forward(self, users, items):
        u, i = self.embeddings(users, items)
        return (self.user_tower(u) * self.item_tower(i)).sum(-1)  # the dot-product logit

    def training_step(self, batch, _):
        users, items, labels = batch["user"], batch["item"], batch["label"]
        loss = self.loss(self(users, items), labels)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _):
        users, items, labels = batch["user"], batch["item"], batch["label"]
        logits = self(users, items)
        self.val_auroc.update(logits, labels.long())  # synced across ranks when computed
        self.log("val_loss", self.loss(logits, labels), sync_dist=True)
        self.log("val_auroc", self.val_auroc, on_epoch=True)

    def test_step(self, batch, _):
        users, items, labels = batch["user"], batch["item"], batch["label"]
        self.test_auroc.update(self(users, items), labels.long())
        self.log("test_auroc", self.test_auroc, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class PrintMetrics(pl.Callback):
    """One line per epoch on rank 0 (the progress bar is off: it is noise in logs)."""

    def on_validation_epoch_end(self, trainer, module):
        if trainer.global_rank == 0 and not trainer.sanity_checking:
            m = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
            print(f"epoch {trainer.current_epoch}: {m}", flush=True)


# %% [markdown]
# ## The logger
# `MLFlowLogger` into a local SQLite store (no server). When a launcher already opened an MLflow
# run for this call (`MLFLOW_RUN_ID` in the environment), the logger writes into that run.
# Without mlflow installed the recipe says so and logs CSV files instead.
#
# The store is created here, once, before the ranks start: `MLFlowLogger` opens it on every
# rank, and two ranks creating a fresh SQLite store's tables at once collide.

# %%
if cfg.mlflow_uri:
    try:
        import mlflow
    except ImportError:
        print(f"note: mlflow is not installed; logging CSV files under {cfg.ckpt_dir}/logs")
        cfg.mlflow_uri = None
    else:
        mlflow.MlflowClient(cfg.mlflow_uri).search_experiments(max_results=1)  # makes the tables


def make_logger(cfg):
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
    if os.environ.get("MLFLOW_RUN_ID"):
        # gpulaunch's tracking opened this call's run: the logger writes into it (its store, its id)
        from gpulaunch.tracking import mlflow_logger
        return mlflow_logger(run_name="lightning_two_tower_ddp")
    if not cfg.mlflow_uri:
        return CSVLogger(cfg.ckpt_dir, name="logs")
    return MLFlowLogger(experiment_name=cfg.experiment, tracking_uri=cfg.mlflow_uri,
                        run_name="lightning_two_tower_ddp",
                        run_id=os.environ.get("MLFLOW_RUN_ID"))


# %% [markdown]
# ## The training function
# No `rt.init()` here: Lightning's DDP strategy creates the process group itself, from the
# environment gpulaunch gives every rank.

# %%
from gpulaunch import distributed
from gpulaunch import runtime as rt


@distributed(gpus=cfg.gpus)
def train(cfg: Config, data: dict) -> Optional[dict]:
    import resource
    import time
    import warnings

    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from gpulaunch.data import StreamingDataset, StreamingLoader

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    backend = cfg.embeddings if cfg.embeddings != "auto" else (
        "torchrec" if have_torchrec() else "nn")
    n_users, n_items = data["n_users"], data["n_items"]
    # each rank streams its own rows; train reshuffles every epoch (seed, epoch), the same
    # number of batches on every rank. Lightning checkpoints the run, so name=None: these
    # loaders are not added to gpulaunch's own checkpoints.
    loaders = [StreamingLoader(StreamingDataset(data[split], seed=cfg.seed, shuffle=shuffle),
                               batch_size=cfg.batch_size, name=None)
               for split, shuffle in (("train", True), ("val", False), ("test", False))]
    train_rows = loaders[0].dataset.num_rows

    model = TwoTower(n_users, n_items, cfg.embedding_dim,
                     [int(s) for s in cfg.layer_sizes.split(",")], cfg.lr, backend)
    checkpoint = ModelCheckpoint(dirpath=cfg.ckpt_dir, filename="best-{epoch}-{val_auroc:.4f}",
                                 monitor="val_auroc", mode="max", save_top_k=1, save_last=True)
    logger = make_logger(cfg)
    gpu = torch.cuda.is_available() and os.environ.get("GPULAUNCH_DEVICE") != "cpu"
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu", strategy="ddp",
        devices=rt.get_local_world_size(),
        num_nodes=rt.get_world_size() // rt.get_local_world_size(),
        max_epochs=cfg.epochs, logger=logger, log_every_n_steps=20,
        callbacks=[checkpoint, LearningRateMonitor(), PrintMetrics()],
        enable_progress_bar=False, deterministic=False)

    # gpulaunch already started every process: Lightning must join them, not spawn its own.
    env = trainer.strategy.cluster_environment
    assert env.creates_processes_externally, (
        f"Lightning would spawn its own processes ({type(env).__name__}); it should have "
        "detected the torchrun-style environment gpulaunch sets")
    assert (trainer.global_rank, trainer.world_size) == (rt.get_global_rank(),
                                                         rt.get_world_size()), \
        (trainer.global_rank, trainer.world_size, os.environ.get("RANK"))
    if trainer.global_rank == 0:
        print(f"Lightning joined the external launch: {type(env).__name__}, "
              f"world size {trainer.world_size}; embeddings: {backend}; "
              f"{n_users} users, {n_items} items, {train_rows} train ratings", flush=True)

    before = trainer.validate(model, loaders[1], verbose=False)[0]["val_auroc"]
    t0 = time.perf_counter()
    trainer.fit(model, loaders[0], loaders[1])
    seconds = time.perf_counter() - t0
    test = trainer.test(model, loaders[2], ckpt_path="best", verbose=False)[0]["test_auroc"]
    best = float(checkpoint.best_model_score)
    if trainer.global_rank == 0:
        print(f"val AUROC {before:.4f} before training -> best {best:.4f}; "
              f"test AUROC (best checkpoint) {test:.4f}", flush=True)
    peak = (torch.cuda.max_memory_allocated() if gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    if trainer.global_rank != 0:
        return None
    run_id = getattr(logger, "run_id", None)
    return {"recipe": "lightning_two_tower_ddp", "world_size": trainer.world_size,
            "device": "cuda" if gpu else "cpu", "embeddings": backend,
            "cluster_environment": type(env).__name__, "metric": "val_auroc",
            "before": float(before), "after": best, "test_auroc": float(test),
            "best_model_path": checkpoint.best_model_path,
            "last_model_path": checkpoint.last_model_path,
            "mlflow_run_id": run_id, "mlflow_uri": cfg.mlflow_uri if run_id else None,
            "train_seconds": seconds,
            "samples_per_s": cfg.epochs * train_rows / seconds, "peak_mem_gib": peak,
            "peak_mem_kind": "cuda_max_allocated" if gpu else "cpu_max_rss"}


# %% [markdown]
# ## Run it

# %%
result = train.distributed(cfg, data)[0]
print(f"\ntwo-tower ({result['embeddings']} embeddings): val AUROC {result['before']:.4f} -> "
      f"{result['after']:.4f} (best), test {result['test_auroc']:.4f}; "
      f"{result['samples_per_s']:.0f} samples/s; best checkpoint {result['best_model_path']}"
      + (f"; MLflow run {result['mlflow_run_id']} in {result['mlflow_uri']}"
         if result["mlflow_run_id"] else ""))
if cfg.out:
    with open(cfg.out, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), **result}, f, indent=2)

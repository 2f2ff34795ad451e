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
# # PyTorch DDP: RetinaNet object detection from scratch
#
# The seed's detection example: torchvision's RetinaNet (ResNet-50 FPN v2, `weights=None`, no
# pretrained backbone either) trained with DDP and SGD (lr 0.04, momentum 0.9, weight decay
# 5e-4 at a global batch of 8 GPUs x 8 images; the learning rate is scaled linearly with the
# global batch here, after a short warm-up), then scored with COCO mean average precision.
#
# Data: a COCO-format folder. By default the recipe draws one itself (coloured squares,
# circles and triangles on a noisy background, with their boxes and classes), so the model can
# really learn without a download; point `coco_dir` at your own COCO folder instead
# (`annotations/instances_<split>.json` and images in `<split>/`, e.g. `val2017`).
# As in the seed, local rank 0 copies the data to node-local disk and the other ranks wait
# at a barrier before reading it.
#
# Run it: `python recipes/pytorch_retinanet_ddp.py` (tiny: 96 px images on 2 CPU workers; it
# shows the loss falling, not a useful detector) or `--full` (320 px, batch 8 per GPU, enough
# steps on one GPU for mAP to rise).

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
    coco_dir: Optional[str] = None   # your COCO folder; None: generate the shapes dataset
    train_split: str = "train"       # annotations/instances_<split>.json + images in <split>/
    val_split: str = "val"
    data_root: str = "data"          # where the generated dataset is written (once, then reused)
    image_size: int = 96             # generated images, and the model's min_size/max_size
    train_images: int = 64
    val_images: int = 8
    epochs: int = 2
    batch_size: int = 2              # per rank (the seed: 8 per GPU)
    lr_at_64: float = 0.04           # the seed's SGD lr for a global batch of 64
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_steps: int = 10           # linear warm-up from lr/100 (from-scratch detectors need it)
    max_grad_norm: Optional[float] = 10.0  # clip (None: off); early focal-loss gradients spike
    num_workers: int = 0             # DataLoader workers per rank (the seed: 8)
    max_train_seconds: Optional[float] = None  # stop training early after this long
    log_every: int = 4
    seed: int = 0
    mlflow_uri: Optional[str] = None  # e.g. sqlite:///mlflow.db; also picks up MLFLOW_RUN_ID
    out: Optional[str] = None        # write the result dict here as JSON


FULL = dict(image_size=320, train_images=1600, val_images=200, epochs=8, batch_size=8,
            warmup_steps=100, num_workers=8, log_every=50)


def config_from_argv(argv=None) -> Config:
    """Defaults (tiny) or --full, then any --field VALUE on top."""
    parser = argparse.ArgumentParser(description="RetinaNet from scratch with DDP")
    parser.add_argument("--full", action="store_true", help=f"GPU sizes: {FULL}")
    for f in dataclasses.fields(Config):
        tp = typing.get_type_hints(Config)[f.name]
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=tp, default=None)
    args = vars(parser.parse_args(argv))
    cfg = Config(**FULL) if args.pop("full") else Config()
    return dataclasses.replace(cfg, **{k: v for k, v in args.items() if v is not None})


cfg = config_from_argv([] if "ipykernel" in sys.modules else None)
print(cfg)

# %% [markdown]
# ## A detection dataset drawn offline, written as a COCO folder
# Three classes that differ in shape, not colour, so the classifier has to look at outlines.

# %%
CLASSES = {1: "square", 2: "circle", 3: "triangle"}


def write_shapes_coco(root: str, splits: dict, size: int, seed: int) -> str:
    """Draw `splits[name]` images per split into root/<name>/ with COCO annotations; reuse if done."""
    import random

    import numpy as np
    from PIL import Image, ImageDraw

    if os.path.exists(os.path.join(root, "COMPLETE")):
        return root
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    rng, noise = random.Random(seed), np.random.default_rng(seed)
    for split, n in splits.items():
        os.makedirs(os.path.join(root, split), exist_ok=True)
        images, anns = [], []
        for i in range(n):
            bg = np.array([rng.randrange(0, 90) for _ in range(3)], np.float32)
            pixels = bg + noise.normal(0, 12, (size, size, 3))
            img = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
            draw = ImageDraw.Draw(img)
            for _ in range(rng.randint(1, 3)):
                cls = rng.choice(list(CLASSES))
                w = rng.randint(size // 6, size // 2)
                x0, y0 = rng.randint(0, size - w), rng.randint(0, size - w)
                colour = tuple(rng.randrange(110, 256) for _ in range(3))
                box = [x0, y0, x0 + w, y0 + w]
                if CLASSES[cls] == "square":
                    draw.rectangle(box, fill=colour)
                elif CLASSES[cls] == "circle":
                    draw.ellipse(box, fill=colour)
                else:
                    draw.polygon([(x0 + w / 2, y0), (x0, y0 + w), (x0 + w, y0 + w)], fill=colour)
                anns.append({"id": len(anns) + 1, "image_id": i, "category_id": cls,
                             "bbox": [x0, y0, w, w], "area": w * w, "iscrowd": 0})
            name = f"{i:06d}.jpg"  # JPEG, like COCO (PNG of noise is slow to write)
            img.save(os.path.join(root, split, name), quality=95)
            images.append({"id": i, "file_name": name, "width": size, "height": size})
        coco = {"images": images, "annotations": anns,
                "categories": [{"id": k, "name": v} for k, v in CLASSES.items()]}
        with open(os.path.join(root, "annotations", f"instances_{split}.json"), "w") as f:
            json.dump(coco, f)
    open(os.path.join(root, "COMPLETE"), "w").close()
    return root


if cfg.coco_dir is None:  # the stand-in for the seed's volume of COCO images
    cfg.coco_dir = os.path.abspath(os.path.join(
        cfg.data_root, f"shapes-coco-{cfg.image_size}px-{cfg.train_images}-{cfg.val_images}"
                       f"-s{cfg.seed}"))
    write_shapes_coco(cfg.coco_dir, {cfg.train_split: cfg.train_images,
                                     cfg.val_split: cfg.val_images}, cfg.image_size, cfg.seed)
    print("dataset:", cfg.coco_dir)
cfg.coco_dir = os.path.abspath(cfg.coco_dir)
try:  # fail here, in the caller, rather than on every rank
    import pycocotools  # noqa: F401  (CocoDetection and the COCO mAP both need it)
except ImportError as e:
    raise ImportError("this recipe needs pycocotools: pip install pycocotools") from e
for split in (cfg.train_split, cfg.val_split):
    ann = os.path.join(cfg.coco_dir, "annotations", f"instances_{split}.json")
    if not os.path.isfile(ann) or not os.path.isdir(os.path.join(cfg.coco_dir, split)):
        raise FileNotFoundError(f"coco_dir={cfg.coco_dir!r} needs {ann} and the images in "
                                f"{os.path.join(cfg.coco_dir, split)}/ (split {split!r})")

# %% [markdown]
# ## Loading a COCO folder
# torchvision's `CocoDetection` (needs `pycocotools`), wrapped for the v2 transforms so boxes
# become XYXY `tv_tensors` that flip together with the image.

# %%
import contextlib
import io

import torch


def coco_dataset(root: str, split: str, train: bool):
    from torchvision import datasets
    from torchvision.transforms import v2

    steps = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if train:
        steps.insert(1, v2.RandomHorizontalFlip())
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools chats on every load
        ds = datasets.CocoDetection(os.path.join(root, split),
                                    os.path.join(root, "annotations", f"instances_{split}.json"),
                                    transforms=v2.Compose(steps))
    ds = datasets.wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "image_id"))
    if train:  # images without boxes teach nothing here: drop them, as torchvision's references do
        keep = [i for i, img_id in enumerate(ds.ids) if ds.coco.getAnnIds(imgIds=img_id, iscrowd=False)]
        ds = torch.utils.data.Subset(ds, keep)
    return ds


def collate(batch):
    return tuple(zip(*batch))  # detection models take lists of images and of targets


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

# %%
from gpulaunch import distributed
from gpulaunch import runtime as rt


@distributed(gpus=cfg.gpus)
def train(cfg: Config) -> Optional[dict]:
    import importlib
    import resource
    import shutil
    import tempfile
    import time

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    from torchmetrics.detection import MeanAveragePrecision
    from torchvision.models.detection import retinanet_resnet50_fpn_v2

    device = rt.init()
    rank, world = rt.get_global_rank(), rt.get_world_size()
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        # fixed image size: let cuDNN pick its fastest convolutions. (Through importlib: cloudpickle
        # cannot pickle the torch.backends modules a plain attribute access would drag in.)
        importlib.import_module("torch.backends.cudnn").benchmark = True
        torch.set_float32_matmul_precision("high")  # fp32 weights, TF32 matmuls

    # Local rank 0 copies the data to this node's disk; everyone waits until it is there.
    local = os.path.join(tempfile.gettempdir(),
                         f"gpulaunch-{os.path.basename(cfg.coco_dir)}-{os.environ['MASTER_PORT']}")
    if rt.get_local_rank() == 0:
        shutil.copytree(cfg.coco_dir, local, dirs_exist_ok=True)
    rt.barrier()

    train_set = coco_dataset(local, cfg.train_split, train=True)
    val_set = coco_dataset(local, cfg.val_split, train=False)
    categories = train_set.dataset.coco.cats
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=cfg.seed)
    loader_kw = dict(collate_fn=collate, num_workers=cfg.num_workers,
                     pin_memory=device.type == "cuda")
    if cfg.num_workers:
        loader_kw.update(prefetch_factor=4, persistent_workers=True)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, **loader_kw)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size,
                            sampler=DistributedSampler(val_set, world, rank, shuffle=False),
                            **loader_kw)

    # From scratch: no detector weights, no ImageNet backbone. num_classes counts background 0.
    model = retinanet_resnet50_fpn_v2(weights=None, weights_backbone=None,
                                      num_classes=max(categories) + 1,
                                      min_size=cfg.image_size, max_size=cfg.image_size,
                                      detections_per_img=100)  # what COCO mAP scores
    if device.type == "cuda" and world > 1:  # batch statistics over the global batch
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    n_params = sum(p.numel() for p in model.parameters())

    global_batch = cfg.batch_size * world
    lr = cfg.lr_at_64 * global_batch / 64  # the linear scaling rule
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, 0.01 + 0.99 * s / max(1, cfg.warmup_steps)))
    rt.print0(f"RetinaNet ResNet-50 FPN v2 from scratch: {n_params / 1e6:.1f}M parameters, "
              f"{len(categories)} classes; {len(train_set)} train / {len(val_set)} val images; "
              f"global batch {global_batch}, SGD lr {lr:.4g} (0.04 x {global_batch}/64)")

    def to_device(images, targets):
        images = [im.to(device, non_blocking=True) for im in images]
        # an image without annotations has no "boxes" key at all: give it empty ones
        targets = [{"boxes": t["boxes"].as_subclass(torch.Tensor).to(device) if "boxes" in t
                    else torch.zeros(0, 4, device=device),
                    "labels": t.get("labels", torch.zeros(0, dtype=torch.int64)).to(device)}
                   for t in targets]
        return images, targets

    @torch.no_grad()
    def evaluate() -> dict:
        """COCO mAP over the whole validation set (each rank scores its slice; synced)."""
        net = model.module
        net.eval()
        metric = MeanAveragePrecision(iou_type="bbox", backend="pycocotools").to(device)
        for images, targets in val_loader:
            images, targets = to_device(images, targets)
            metric.update(net(images), targets)
        net.train()
        with contextlib.redirect_stdout(io.StringIO()):
            out = metric.compute()  # gathers every rank's detections first
        return {k: float(out[k]) for k in ("map", "map_50", "map_75")}

    before = evaluate()
    rt.print0(f"before training: mAP {before['map']:.4f}, mAP@50 {before['map_50']:.4f}")
    tracker = start_mlflow(cfg, "pytorch_retinanet_ddp") if rank == 0 else None

    losses, step = [], 0
    t0 = time.perf_counter()
    stopped = False
    for epoch in range(cfg.epochs):
        if stopped:
            break
        sampler.set_epoch(epoch)
        for images, targets in loader:
            images, targets = to_device(images, targets)
            parts = model(images, targets)  # {"classification": focal loss, "bbox_regression": L1}
            loss = sum(parts.values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            warmup.step()
            step += 1
            avg = torch.stack([loss.detach()] + [v.detach() for v in parts.values()])
            dist.all_reduce(avg)
            avg = (avg / world).tolist()
            losses.append(avg[0])
            if step % cfg.log_every == 0:
                rt.print0(f"epoch {epoch} step {step:5d}  loss {avg[0]:.4f}  "
                          f"(cls {avg[1]:.4f}, box {avg[2]:.4f})  lr {warmup.get_last_lr()[0]:.2e}")
                if tracker:
                    tracker.log_metrics({"loss": avg[0], "loss_cls": avg[1], "loss_box": avg[2]},
                                        step=step)
            # every rank must stop at the same step: decide on rank 0's clock, then broadcast
            if cfg.max_train_seconds and step % cfg.log_every == 0:
                stop = torch.tensor(float(time.perf_counter() - t0 > cfg.max_train_seconds),
                                    device=device)
                dist.broadcast(stop, 0)
                if stop.item():
                    stopped = True
                    rt.print0(f"max_train_seconds={cfg.max_train_seconds} reached at step {step}")
                    break
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = evaluate()
    k = max(1, min(10, len(losses) // 4))  # mean of the first and last k steps: less noise
    loss_first, loss_last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    rt.print0(f"loss (mean of {k} steps) {loss_first:.4f} -> {loss_last:.4f}; "
              f"mAP {before['map']:.4f} -> {after['map']:.4f}, "
              f"mAP@50 {before['map_50']:.4f} -> {after['map_50']:.4f}")
    if tracker:
        tracker.log_metrics({"val_map": after["map"], "val_map_50": after["map_50"]}, step=step)
        if not os.environ.get("MLFLOW_RUN_ID"):  # gpulaunch ends its own run with the outcome
            tracker.end_run()
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    rt.barrier()
    if rt.get_local_rank() == 0:
        shutil.rmtree(local, ignore_errors=True)
    if rank != 0:
        return None
    return {"recipe": "pytorch_retinanet_ddp", "world_size": world, "device": device.type,
            "parameters": n_params, "metric": "map", "before": before["map"],
            "after": after["map"], "map_50_before": before["map_50"],
            "map_50_after": after["map_50"], "loss_first": loss_first, "loss_last": loss_last,
            "steps": step, "stopped_by_time_cap": stopped, "lr": lr, "loss_history": losses, "train_seconds": seconds,
            "samples_per_s": step * global_batch / seconds, "peak_mem_gib": peak,
            "peak_mem_kind": "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss"}


# %% [markdown]
# ## Run it

# %%
result = train.distributed(cfg)[0]
print(f"\nRetinaNet: loss {result['loss_first']:.3f} -> {result['loss_last']:.3f} over "
      f"{result['steps']} steps; mAP {result['before']:.4f} -> {result['after']:.4f} "
      f"(mAP@50 {result['map_50_before']:.4f} -> {result['map_50_after']:.4f}); "
      f"{result['samples_per_s']:.1f} images/s, peak {result['peak_mem_gib']:.2f} GiB")
if cfg.out:
    with open(cfg.out, "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), **result}, f, indent=2)

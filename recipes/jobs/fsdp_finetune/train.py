"""FSDP2 fine-tune of a Llama-shaped model, written to run as a gpulaunch job: every rank runs
this script (torchrun's environment), checkpoints go to the job's own folder, and an attempt
that starts after a failure resumes from the newest complete checkpoint.

    gpulaunch job run recipes/jobs/fsdp_finetune/job.yaml --watch

The model is gpulaunch's reference Llama (random init here; load your weights in ``build``)
and the data are synthetic token sequences with a learnable pattern, so the loss falls.
"""

import argparse
import os
import time

import torch

from gpulaunch import runtime as rt
from gpulaunch.parallel import prepare, resume, save_checkpoint
from gpulaunch.parallel.reference_model import Llama, LlamaConfig


def build(args) -> Llama:
    cfg = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=args.layers, n_heads=4,
                      n_kv_heads=2, ffn_dim=args.dim * 2, max_seq_len=args.seq_len)
    torch.manual_seed(0)                   # the same initial weights on every rank
    return Llama(cfg)


def batch(step: int, args, device):
    """Sequences that count upwards from a random start: the next token is predictable."""
    g = torch.Generator().manual_seed(step * 1000 + rt.get_global_rank())
    start = torch.randint(0, 256, (args.batch_size, 1), generator=g)
    tokens = (start + torch.arange(args.seq_len + 1)) % 256
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--mixed-precision", default=None, help="bf16 on GPUs")
    args = p.parse_args()
    # the job's folder outlives its attempts (GPULAUNCH_JOB_DIR); outside a job: here
    ckpt = os.path.join(os.environ.get("GPULAUNCH_JOB_DIR", "."), "checkpoints")

    device = rt.init()
    prepared = prepare(build(args), lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                       strategy="fsdp", mixed_precision=args.mixed_precision)
    start = resume(ckpt, prepared)
    rt.print0(f"attempt {os.environ.get('GPULAUNCH_ATTEMPT', '-')}: steps {start + 1}.."
              f"{args.steps}, {rt.get_world_size()} ranks, FSDP2")
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, args, device)
        loss = prepared.model(x, y)
        prepared.backward(loss)
        prepared.step()
        prepared.zero_grad()
        if step % args.ckpt_every == 0 or step == args.steps:
            save_checkpoint(ckpt, prepared, step=step)
            rt.print0(f"step {step} loss {loss.item():.3f} "
                      f"({(time.perf_counter() - t0) / (step - start):.2f} s/step)")
    rt.barrier()


if __name__ == "__main__":
    main()

"""`gpulaunch plan`: the planner from the command line. add_parser() registers it on the main CLI."""
from __future__ import annotations

import argparse
import json
import sys

from ..hardware.catalog import MODELS
from . import catalog

GiB = 1 << 30


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="predict per-GPU memory and step time for DDP/FSDP/ZeRO and pick one",
                              description="Predict per-GPU memory and relative step time for DDP, FSDP2 and "
                                          "DeepSpeed ZeRO-1/2/3 (with/without CPU offload), and recommend the "
                                          "fastest that fits.")
    _arguments(p)
    p.set_defaults(func=main)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"built-in name ({', '.join(catalog.names())}) or a Hugging Face config.json "
                                 "or model directory")
    p.add_argument("--micro-batch-size", "-b", type=int, default=1)
    p.add_argument("--seq-len", "-s", type=int, default=2048)
    p.add_argument("--precision", default="bf16", choices=["bf16", "bf16-pure", "fp16", "fp32"])
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--optimizer-impl", default="foreach", choices=["foreach", "fused"])
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--activation-checkpointing", "--ac", action="store_true")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: GPUs detected here, else 1")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", default=None, help=f"GPU type when not detected: {', '.join(MODELS)}")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="override the GPU's memory")
    p.add_argument("--strategies", default=None, help="comma list, e.g. ddp,fsdp,zero3+offload")
    p.add_argument("--no-offload", action="store_true", help="leave out the CPU-offload variants")
    p.add_argument("--mesh", default=None,
                   help="plan a device mesh over the GPUs: NAME=SIZE pairs of replicate, shard, context, "
                        "tensor, e.g. replicate=2,shard=4 (HSDP) or shard=4,tensor=2 (FSDP2 x TP)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def main(args) -> int:
    from .plan import plan
    try:
        p = plan(args.model, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                 precision=args.precision, optimizer=args.optimizer, optimizer_impl=args.optimizer_impl,
                 lora_rank=args.lora_rank, activation_checkpointing=args.activation_checkpointing,
                 gpus_per_node=args.gpus_per_node, nodes=args.nodes, gpu=args.gpu,
                 gpu_memory_bytes=int(args.gpu_memory_gib * GiB) if args.gpu_memory_gib else None,
                 strategies=args.strategies.split(",") if args.strategies else None, offload=not args.no_offload,
                 mesh=args.mesh)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"gpulaunch plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict(), indent=2) if args.json else str(p))
    return 0 if p.fits else 1


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpulaunch.planner")
    sub = ap.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = ap.parse_args(argv)
    return args.func(args)

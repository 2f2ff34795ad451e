"""The two sides of bench/torchtitan_gpu.py, each run in a process of its own.

titan: torchtitan's ``Trainer`` (its model, parallelize function, optimizer, loss, compile, AC and
float8 converter) configured by its own command line; a train spec ``llama3_bench`` adds only a
flavour of ``--layers`` blocks and random tokens instead of its tokenizer and dataset.
ours: the reference model of the same shape through ``prepare()``, the same optimizer settings
(torchtitan's defaults: AdamW lr 8e-4, betas 0.9/0.95, weight decay 0.1, fused; clip at 1.0).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import time

MARKS: dict = {}


def titan_ffn(dim: int, multiple_of: int, multiplier: float) -> int:
    """torchtitan's (and Meta's Llama-3's) SwiGLU width from the model dimension."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


def num_params(shape: dict) -> int:
    d, L, V, F = shape["dim"], shape["n_layers"], shape["vocab_size"], shape["ffn_dim"]
    hd = d // shape["n_heads"]
    attn = 2 * d * shape["n_heads"] * hd + 2 * d * shape["n_kv_heads"] * hd
    return L * (attn + 3 * d * F + 2 * d) + d + 2 * V * d


def flops_per_token(shape: dict, seq: int) -> float:
    """torchtitan's count: 6 x parameters without the embedding + 12 x layers x dim x seq."""
    dense = num_params(shape) - shape["vocab_size"] * shape["dim"]
    return 6 * dense + 12 * shape["n_layers"] * shape["dim"] * seq


def titan_argv(a, precision: str) -> list[str]:
    argv = ["--model.name", "llama3_bench", "--model.flavor", "bench",
            "--training.local_batch_size", str(a.batch), "--training.seq_len", str(a.seq),
            "--training.steps", str(a.warmup + a.steps), "--training.max_norm", "1.0",
            "--lr_scheduler.warmup_steps", "1", "--optimizer.implementation", "fused",
            "--metrics.log_freq", "1000000", "--job.dump_folder", os.path.join(tempfile.gettempdir(), "titan_bench")]
    if a.ac == "none":
        argv += ["--activation_checkpoint.mode", "none"]
    else:
        argv += ["--activation_checkpoint.mode", a.ac, "--activation_checkpoint.selective_ac_option", "op"]
    if not a.dry_run:
        argv += ["--compile.enable", "--compile.components", "model,loss"]
    if precision == "fp8":
        argv += ["--model.converters", "quantize.linear.float8",
                 "--quantize.linear.float8.recipe_name", a.fp8_recipe]
    return argv


def _titan_spec(shape: dict, a):
    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.models import llama3
    from torchtitan.protocols import train_spec as ts

    multiple_of = 1024 if shape["dim"] >= 4096 else 256
    if titan_ffn(shape["dim"], multiple_of, 1.3) != shape["ffn_dim"]:
        raise SystemExit(f"torchtitan's FFN width {titan_ffn(shape['dim'], multiple_of, 1.3)} != ours {shape['ffn_dim']}")
    args = dataclasses.replace(llama3.llama3_args["8B"], dim=shape["dim"], n_layers=shape["n_layers"],
                               n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"],
                               vocab_size=shape["vocab_size"], multiple_of=multiple_of, ffn_dim_multiplier=1.3,
                               rope_theta=shape["rope_theta"])
    llama3.llama3_args["bench"] = args       # the mapping the llama3 spec looks flavours up in

    class RandomTokens(BaseDataLoader):
        def __init__(self, batch, seq, vocab):
            self.batch, self.seq, self.vocab = batch, seq, vocab

        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            while True:
                t = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)
                yield {"input": t[:, :-1]}, t[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    def build_loader(dp_world_size, dp_rank, tokenizer, job_config, **_):
        return RandomTokens(job_config.training.local_batch_size, job_config.training.seq_len, shape["vocab_size"])

    spec = dataclasses.replace(ts.get_train_spec("llama3"), build_tokenizer_fn=None, build_dataloader_fn=build_loader)
    if "llama3_bench" not in getattr(ts, "_extra_train_specs", {}):
        ts.register_train_spec("llama3_bench", spec)
    return spec, args


def titan_worker(a, shape: dict) -> dict:
    # before torchtitan is imported: 0.2.2's ConfigManager.parse_args(args=sys.argv[1:]) takes
    # its default at import time, so a later sys.argv is never read (seen on the GPU, exit 2)
    argv = titan_argv(a, a.precision)
    sys.argv = ["torchtitan.train"] + argv
    import torch
    spec, args = _titan_spec(shape, a)
    if a.dry_run and not torch.cuda.is_available():
        # torchtitan trains on CUDA only: here, check its configuration and model instead
        from torchtitan.config import ConfigManager
        cfg = ConfigManager().parse_args(argv)
        with torch.device("meta"):
            model = spec.model_cls(spec.model_args[cfg.model.flavor])
        n = sum(p.numel() for p in model.parameters())
        return {"side": "titan", "precision": a.precision, "dry_run": True, "params": n,
                "params_match_ours": n == num_params(shape), "converters": cfg.model.converters,
                "ac": cfg.activation_checkpoint.mode, "steps": cfg.training.steps}
    import torchtitan.train as tt

    total = a.warmup + a.steps

    class TimedTrainer(tt.Trainer):
        def train_step(self, data_iterator):
            super().train_step(data_iterator)
            if self.step in (a.warmup, total):
                torch.cuda.synchronize()
                MARKS[self.step] = time.perf_counter()
                if self.step == total:
                    MARKS["peak"] = torch.cuda.max_memory_allocated()
                    MARKS["params"] = sum(p.numel() for m in self.model_parts for p in m.parameters())

    tt.main(TimedTrainer)
    dt = MARKS[total] - MARKS[a.warmup]
    return {"side": "titan", "precision": a.precision, "tokens_per_s": a.batch * a.seq * a.steps / dt,
            "step_s": dt / a.steps, "peak_gib": MARKS["peak"] / 2 ** 30, "params": MARKS["params"],
            "torchtitan": __import__("torchtitan").__version__, "torch": torch.__version__}


def ours_worker(a, shape: dict) -> dict:
    import torch

    from gpulaunch.parallel import prepare
    from gpulaunch.parallel.reference_model import Llama, LlamaConfig

    cuda = torch.cuda.is_available()
    if a.precision == "fp8" and not cuda:
        return {"side": "ours", "precision": "fp8", "skipped": "FP8 needs a GPU with FP8 tensor cores"}
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = LlamaConfig(vocab_size=shape["vocab_size"], dim=shape["dim"], n_layers=shape["n_layers"],
                      n_heads=shape["n_heads"], n_kv_heads=shape["n_kv_heads"], ffn_dim=shape["ffn_dim"],
                      max_seq_len=a.seq, rope_theta=shape["rope_theta"])
    torch.manual_seed(0)
    with dev:
        model = Llama(cfg)
    n = sum(p.numel() for p in model.parameters())
    p = prepare(model, lambda ps: torch.optim.AdamW(ps, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                                    fused=cuda),
                strategy="none", mixed_precision="bf16", precision="fp8" if a.precision == "fp8" else None,
                fp8_recipe=a.fp8_recipe, compile=not a.dry_run,
                activation_checkpointing=False if a.ac == "none" else a.ac, max_grad_norm=1.0, device=dev)
    g = torch.Generator().manual_seed(0)
    total = a.warmup + a.steps
    t0 = None
    loss = None
    for step in range(1, total + 1):
        t = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g).to(dev, non_blocking=True)
        loss = p.model(t[:, :-1], t[:, 1:])
        p.backward(loss)
        p.step()
        p.zero_grad()
        if step == a.warmup:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"side": "ours", "precision": a.precision, "tokens_per_s": a.batch * a.seq * a.steps / dt,
            "step_s": dt / a.steps, "peak_gib": (torch.cuda.max_memory_allocated() / 2 ** 30) if cuda else 0.0,
            "params": n, "params_match_formula": n == num_params(shape), "loss": float(loss),
            "torch": torch.__version__}

"""The end of every recipe, in the caller: print what ran, reload the saved model with
``from_pretrained``, print a short generation, and write the results JSON (``--results``)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return v


def print_result(r: dict) -> None:
    keys = ["technique", "wrapper", "world_size", "precision", "parameters", "trainable_parameters",
            "eval_loss_before", "eval_loss_after", "steps", "seq_len", "fill", "tokens",
            "tokens_per_second", "steady_tokens_per_second", "mfu", "train_seconds",
            "peak_memory_gib", "output"]
    print("\n".join(f"  {k:22s} {_fmt(r[k])}" for k in keys if k in r), flush=True)


def reload_and_generate(output: str, prompt: str, reference: str | None = None) -> str:
    import os

    import torch

    from . import outputs
    gpu = torch.cuda.is_available() and os.environ.get("GPULAUNCH_FORCE_CPU") != "1"
    model, tok = outputs.load_trained(output, dtype=torch.bfloat16 if gpu else torch.float32,
                                      device="cuda" if gpu else "cpu")
    answer = outputs.generate(model, tok, prompt)
    print(f"reloaded {output} with from_pretrained ({type(model).__name__})", flush=True)
    print(f"  prompt:    {prompt}\n  generated: {answer}"
          + (f"\n  reference: {reference}" if reference else ""), flush=True)
    return answer


def finish(opts, results: list[dict]) -> dict:
    """Rank 0's result, plus the generation; written to ``opts.results`` when set."""
    from .chat_data import load_chat_datasets, sample_prompt
    from .long_chat import is_preset
    r = dict(results[0])
    print(f"\n{opts.recipe}: rank 0 result", flush=True)
    print_result(r)
    if r.get("eval_loss_before") is not None and r["eval_loss_after"] >= r["eval_loss_before"]:
        print("  WARNING: the eval loss did not fall", flush=True)
    if r.get("output"):
        data = None if is_preset(opts.data) else opts.data   # generated: ask a shipped question
        _, eval_ds = load_chat_datasets(data, opts.eval_data, seed=opts.seed)
        prompt, reference = sample_prompt(eval_ds)
        r["generation"] = {"prompt": prompt, "reference": reference,
                           "generated": reload_and_generate(r["output"], prompt, reference)}
    else:
        print("  not saved (-x save=false): no reload, no generation", flush=True)
    if r.get("timeline", {}).get("exit") and opts.started_at:
        from .metrics import time_split
        r["time_split"] = time_split(opts.started_at, r["timeline"],
                                     step_seconds=r.get("step_seconds", 0.0),
                                     eval_seconds=r.get("eval_seconds", 0.0))
        print("  time (s)               " + ", ".join(
            f"{k[:-2]} {v:.1f}" for k, v in r["time_split"].items()), flush=True)
    if opts.results:
        Path(opts.results).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.results).write_text(json.dumps(r, indent=2, default=str))
        print(f"results written to {opts.results}", flush=True)
    return r

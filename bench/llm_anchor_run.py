"""One by-hand anchor row for ``bench/llm_speed.py``, in a process of its own.

On a GPU it imports the shared anchor script itself (``hf_lora_loop.py`` / ``hf_llama_loop.py``,
carried under ``.device-carry/anchors/``) and calls its ``run(compile, 4, 2048, steps)``: the
anchor's own loop, model and timing. ``--fuse merged|split`` runs the same anchor loop with
``gpulaunch.hf.fuse_lora`` applied to the peft model it builds (its ``get_peft_model`` wrapped),
so the fused-LoRA row differs from the anchor by the fused forward only.

``--smoke``: no GPU: a CPU mirror of the anchor loop (same steps: HF Llama + peft, AdamW, timed
steps, median after warm-up) on a tiny config, to check the plumbing; its numbers mean nothing.

    python bench/llm_anchor_run.py --kind lora --compile --fuse merged --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANCHORS = {"lora": "hf_lora_loop.py", "full": "hf_llama_loop.py"}
SEARCH = [ROOT / ".device-carry" / "anchors", ROOT.parent / "shared" / "anchors",
          ROOT.parent.parent / "shared" / "anchors", Path("/work/shared/anchors")]


def find_anchor(kind: str) -> Path:
    for d in SEARCH:
        p = d / ANCHORS[kind]
        if p.is_file():
            return p
    raise SystemExit(f"anchor {ANCHORS[kind]} not found in {', '.join(map(str, SEARCH))}: "
                     f"run `python bench/llm_speed.py --carry` where shared/anchors exists")


def load_anchor(kind: str):
    path = find_anchor(kind)
    spec = importlib.util.spec_from_file_location(f"anchor_{kind}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def with_fused_lora(anchor, mode: str) -> None:
    """Make the anchor's own loop build a fused peft model."""
    from gpulaunch.hf import fuse_lora
    real = anchor.get_peft_model

    def fused(*a, **kw):
        model = real(*a, **kw)
        report = fuse_lora(model, mode=mode)
        print(f"fuse_lora: {report['fused']} fused, {len(report['skipped'])} skipped", flush=True)
        return model

    anchor.get_peft_model = fused


def cpu_mirror(kind: str, compile_model: bool, fuse: str, steps: int) -> dict:
    """The anchor loop's steps on a tiny CPU model (plumbing check only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    mb, seq = 2, 64
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=seq, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules="all-linear", bias="none",
                                                 task_type="CAUSAL_LM"))
        if fuse != "none":
            from gpulaunch.hf import fuse_lora
            fuse_lora(model, mode=fuse)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    fwd = torch.compile(model, backend="aot_eager") if compile_model else model
    x = torch.randint(0, cfg.vocab_size, (mb, seq))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = fwd(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    st = sorted(times[1:])[len(times[1:]) // 2]
    return dict(kind=kind, compile=compile_model, mb=mb, seq=seq, step_s=round(st, 4),
                tok_s=round(mb * seq / st), loss=float(out.loss), smoke=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=sorted(ANCHORS), required=True)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fuse", choices=("none", "merged", "split"), default="none")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if args.fuse != "none" and args.kind != "lora":
        raise SystemExit("--fuse needs --kind lora")
    if args.smoke:
        row = cpu_mirror(args.kind, args.compile, args.fuse, max(3, min(args.steps, 4)))
        row["anchor"] = "cpu mirror"
    else:
        anchor, path = load_anchor(args.kind)
        if args.fuse != "none":
            with_fused_lora(anchor, args.fuse)
        row = anchor.run(args.compile, 4, 2048, steps=args.steps)
        row["anchor"] = path.name
    row["fuse"] = args.fuse
    Path(args.json).write_text(json.dumps(row))
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

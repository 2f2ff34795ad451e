"""Where a recipe's trained model goes, and how it comes back.

Rank 0 writes the adapter or full model (``save_pretrained`` layout: safetensors, config,
tokenizer) to a local directory or to any fsspec URL (``s3://``, ``gs://``, ``file://``...; a
URL is staged in a local directory and uploaded once complete). ``load_trained`` reloads it with
``from_pretrained``, the way a user would, and ``generate`` prints a short answer from it.

A LoRA adapter needs its base model to reload. With ``--model PATH`` that is PATH; for a
randomly initialised base (tiny or ``--full``), rank 0 also saves the base weights under
``base_model/`` so the adapter is reloadable anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

BASE_DIR = "base_model"


def is_url(path: str) -> bool:
    return "://" in path


def staging_dir(output: str) -> str:
    """The local directory rank 0 writes into: the output itself, or a staging copy of a URL."""
    if not is_url(output):
        Path(output).mkdir(parents=True, exist_ok=True)
        return str(Path(output).resolve())
    d = tempfile.mkdtemp(prefix="gpulaunch-llm-out-")
    return d


def publish(local_dir: str, output: str) -> None:
    """Rank 0: upload the staged directory to ``output`` when it is a URL."""
    if not is_url(output) or local_dir == output:
        return
    import fsspec
    fs, root = fsspec.core.url_to_fs(output)
    fs.makedirs(root, exist_ok=True)
    for dirpath, _, files in os.walk(local_dir):
        rel = os.path.relpath(dirpath, local_dir)
        for name in files:
            dest = root if rel == "." else f"{root}/{rel}"
            fs.makedirs(dest, exist_ok=True)
            fs.put_file(os.path.join(dirpath, name), f"{dest}/{name}")
    shutil.rmtree(local_dir, ignore_errors=True)


def fetch(output: str) -> str:
    """A local directory holding ``output`` (downloaded when it is a URL)."""
    if not is_url(output):
        return output
    import fsspec
    fs, root = fsspec.core.url_to_fs(output)
    local = tempfile.mkdtemp(prefix="gpulaunch-llm-in-")
    fs.get(root.rstrip("/") + "/", local + "/", recursive=True)
    return local


# ------------------------------------------------------------------------------ reload
def load_trained(output: str, *, dtype=None, device: str = "cpu"):
    """(model, tokenizer) from a saved recipe output: a full model, or base + LoRA adapter."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    local = fetch(output)
    dtype = dtype or torch.float32
    # transformers 4.x (LLM Foundry's environment) names it torch_dtype
    dkw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    tok = AutoTokenizer.from_pretrained(local)
    adapter_cfg = Path(local) / "adapter_config.json"
    if adapter_cfg.exists():
        from peft import PeftModel
        base_path = Path(local) / BASE_DIR
        if not base_path.exists():
            base_path = json.loads(adapter_cfg.read_text())["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(str(base_path), **{dkw: dtype})
        if len(tok) > base.get_input_embeddings().num_embeddings:
            base.resize_token_embeddings(len(tok))
        model = PeftModel.from_pretrained(base, local)
    else:
        model = AutoModelForCausalLM.from_pretrained(local, **{dkw: dtype})
    return model.to(device).eval(), tok


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy answer to one user turn, through the chat template."""
    import torch
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    ids = {k: v.to(model.device) for k, v in ids.items()}
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


# ------------------------------------------------------------------------------ checks
def saved_tensors(local_dir: str) -> dict:
    """Every tensor in the directory's safetensors files (sharded or not), by name."""
    from safetensors.torch import load_file
    tensors = {}
    files = sorted(Path(local_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {local_dir}")
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def compare_with_model(saved: dict, named_full_tensors, tied: set[str] = frozenset()) -> dict:
    """Compare saved tensors with the model's full (gathered) ones: names, shapes, values.
    Returns a report; ``ok`` is True only if every parameter is saved, non-empty and equal."""
    missing, empty, shape_mismatch, max_diff, n = [], [], [], 0.0, 0
    for name, t in named_full_tensors:
        if name not in saved:
            if name not in tied:
                missing.append(name)
            continue
        s = saved[name]
        n += 1
        if s.numel() == 0:
            empty.append(name)
        elif tuple(s.shape) != tuple(t.shape):
            shape_mismatch.append((name, tuple(s.shape), tuple(t.shape)))
        else:
            max_diff = max(max_diff, (s.float() - t.detach().float().cpu()).abs().max().item())
    return {"ok": not (missing or empty or shape_mismatch) and max_diff == 0.0 and n > 0,
            "tensors_compared": n, "missing": missing[:5], "empty": empty[:5],
            "shape_mismatch": shape_mismatch[:5], "max_abs_diff": max_diff,
            "saved_numel": sum(t.numel() for t in saved.values())}

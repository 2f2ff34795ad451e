"""Small GPU runs of the six LLM recipes at real sequence length (issue 19): tiny models,
``--data long`` (generated chats that fill 1024-token sequences), a few steps on one GPU, each
started as a user starts it (``python recipes/<name>.py ...``). Each checks the technique that
really ran, that the eval loss fell, that steps carried full sequences, and that tokens/s, MFU
and peak memory were measured.

Self-contained (no fixture of tests/gpu/conftest.py is needed): every test carries the ``gpu``
marker and is skipped, with the reason, where no CUDA GPU is visible. The check runs torch in a
subprocess, so this process (the caller of every launch) never creates a CUDA context.

Packages: the TRL recipes need trl, datasets and deepspeed (``bench/llm_recipes_gpu_wheels.sh``
builds them; ``LLM_SITE_TRL`` names where they were installed, else the interpreter's own
path). Unsloth and Axolotl come from ``bench/llm_frameworks_bundle.sh``'s trees
(``LLM_SITE_UNSLOTH`` / ``LLM_SITE_AXOLOTL``, default /tmp/site-<name>:/tmp/site-fwcommon);
their tests are skipped, saying so, when those are absent. LLM Foundry needs torch 2.7, which
cannot be carried to the GPU machine: its test runs only where llm-foundry imports.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
SHAPE = ("--gpus", "1", "--data", "long", "--seq-len", "1024", "--batch-size", "2",
         "--max-steps", "8", "--eval-steps", "8", "--measure-after", "2", "--eval-batches", "1",
         "--report-to", "none")
DEFAULT_SITES = {"unsloth": "/tmp/site-unsloth:/tmp/site-fwcommon",
                 "axolotl": "/tmp/site-axolotl:/tmp/site-fwcommon"}


@functools.lru_cache(maxsize=1)
def cuda_gpus() -> tuple[int, str]:
    """(GPUs torch can use, why not) from a subprocess: no CUDA context here."""
    code = ("import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0);"
            "print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 0, f"probing torch failed: {e}"
    if p.returncode != 0:
        return 0, f"torch did not import: {p.stderr.strip()[-300:]}"
    lines = p.stdout.split("\n")
    return int(lines[0]), lines[1] if len(lines) > 1 else ""


@pytest.fixture(autouse=True)
def _needs_cuda():
    n, _ = cuda_gpus()
    if not n:
        pytest.skip("no CUDA GPU (torch.cuda.device_count() is 0): the LLM recipes' GPU tests "
                    "run on the lent GPU machine (bash scripts/gpu_suite.sh, or "
                    "python -m pytest tests/gpu/test_llm_recipes_gpu.py there)")


def site(name: str) -> str:
    return os.environ.get(f"LLM_SITE_{name.upper()}") or DEFAULT_SITES.get(name, "")


def env_for(name: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPULAUNCH_FORCE_CPU", "MLFLOW_TRACKING_URI")}
    paths = [str(ROOT / "src"), str(RECIPES), *[p for p in site(name).split(":") if p]]
    if name == "trl" and env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=":".join(paths), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", GPULAUNCH_HOME=str(tmp_path / "home"),
               GPULAUNCH_TRACKING="0", GPULAUNCH_LLM_DATA_CACHE=str(tmp_path / "data"),
               HF_HOME=str(tmp_path / "hf"), AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    return env


def importable(name: str, modules: tuple[str, ...], tmp_path: Path) -> str | None:
    """None when every module imports in that site's environment, else the error."""
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    p = subprocess.run([sys.executable, "-c", code], env=env_for(name, tmp_path),
                       capture_output=True, text=True, timeout=300, check=False)
    return None if p.returncode == 0 else p.stderr.strip().splitlines()[-1][-300:]


def run_recipe(recipe: str, tmp_path: Path, *args: str, name: str = "trl",
               timeout: float = 600) -> tuple[dict, str]:
    results = tmp_path / "result.json"
    cmd = [sys.executable, str(RECIPES / f"{recipe}.py"), *SHAPE, *args, "--results",
           str(results), "--output", str(tmp_path / "out")]
    p = subprocess.run(cmd, cwd=tmp_path, env=env_for(name, tmp_path), capture_output=True,
                       text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"{recipe} failed:\n{p.stdout[-5000:]}\n{p.stderr[-5000:]}"
    return json.loads(results.read_text()), p.stdout


def check_measured(r: dict) -> None:
    assert r["eval_loss_after"] < r["eval_loss_before"], r["eval_losses"]
    assert r["fill"] > 0.9, r["step_tokens"]        # steps carried full sequences
    assert r["steady_tokens_per_second"] > 0 and r["peak_memory_gib"] > 0
    assert r["memory_kind"] == "cuda max_memory_allocated"
    if any(k in cuda_gpus()[1] for k in ("H100", "H200", "A100")):
        assert 0 < r["mfu"] < 1, r["mfu"]
    assert r["time_split"]["steps_s"] > 0 and r["time_split"]["outside_steps_s"] > 0


# One rank (SHAPE's --gpus 1): the HF Trainer wraps no single process in DDP, so the LoRA-DDP
# model stays the PEFT model (the H200 run of 2026-12-04 reported exactly that); FSDP2 and
# ZeRO-3 wrap at any world size.
@pytest.mark.parametrize(("recipe", "technique", "wrapper"), [
    ("trl_sft_lora_ddp", "ddp", "PeftModelForCausalLM"),
    ("trl_sft_lora_fsdp", "fsdp2", "fsdp2"),
    ("trl_sft_full_zero3", "zero3", "deepspeed")])
def test_trl_recipe_at_real_length(recipe, technique, wrapper, tmp_path):
    missing = importable("trl", ("trl", "datasets", "peft", "deepspeed"), tmp_path)
    assert missing is None, (f"{missing}: carry the TRL stack (bash bench/llm_recipes_gpu_wheels.sh"
                             " here, then install .device-carry/llm-whl into LLM_SITE_TRL there)")
    r, out = run_recipe(recipe, tmp_path)
    assert (r["technique"], r["wrapper"]) == (technique, wrapper)
    assert r["precision"] == "bf16" and r["world_size"] == 1
    check_measured(r)
    if recipe == "trl_sft_full_zero3":
        assert r["export_check"]["ok"], r["export_check"]
    assert "generated:" in out                          # saved, reloaded with from_pretrained


def test_trl_packing_on_gpu(tmp_path):
    """--packed: TRL's bfd packing of the short shipped rows, padding-free, on SDPA."""
    missing = importable("trl", ("trl", "datasets", "peft"), tmp_path)
    assert missing is None, missing
    r, _ = run_recipe("trl_sft_lora_ddp", tmp_path, "--packed", "--data", "shipped")
    assert r["packed"] and r["technique"] == "ddp"
    check_measured(r)


def test_unsloth_lora_on_gpu(tmp_path):
    missing = importable("unsloth", ("unsloth", "trl"), tmp_path)
    if missing:
        pytest.skip(f"Unsloth is not on this machine ({missing}): carry "
                    ".device-carry/llm-frameworks.tar.xz (bench/llm_frameworks_bundle.sh) and "
                    "unpack it into /tmp (or set LLM_SITE_UNSLOTH)")
    r, _ = run_recipe("unsloth_sft_lora_ddp", tmp_path, "-x", "save=false", name="unsloth")
    # one rank: the recipe runs Unsloth without DDP and says so ("single"; H200, 2026-12-04)
    assert r["technique"] == "single" and r["framework"].startswith("unsloth ")
    check_measured(r)


def test_axolotl_qlora_on_gpu(tmp_path):
    missing = importable("axolotl", ("axolotl.train", "bitsandbytes"), tmp_path)
    if missing:
        pytest.skip(f"Axolotl is not on this machine ({missing}): carry "
                    ".device-carry/llm-frameworks.tar.xz (bench/llm_frameworks_bundle.sh) and "
                    "unpack it into /tmp (or set LLM_SITE_AXOLOTL)")
    r, _ = run_recipe("axolotl_qlora_ddp", tmp_path, name="axolotl")
    assert r["adapter"] == "qlora" and r["load_in_4bit"] is True     # a 4-bit base, for real
    check_measured(r)


def test_llmfoundry_on_gpu(tmp_path):
    missing = importable("trl", ("llmfoundry",), tmp_path)
    if missing:
        pytest.skip("llm-foundry is not on this machine: it needs torch 2.7 (every release pins "
                    "torch<2.7.1) and that environment (the 865 MB torch wheel alone) cannot be "
                    "carried in a device call's 64 MiB; it runs on CPU ranks instead "
                    "(tests/recipes/test_recipes_llm.py, scripts/recipe_venv.sh llmfoundry)")
    r, _ = run_recipe("llmfoundry_fsdp", tmp_path, "-x", "global_batch=4")
    assert r["technique"] in ("fsdp1", "fsdp2", "ddp") and r["export_check"]["ok"]
    check_measured(r)


# ------------------------------------------------------------------ the fast settings (--speed auto)
def test_fast_settings_are_in_effect_on_gpu(tmp_path):
    """--speed auto (the default) on a GPU, the recipe's gpt-oss (tiny): the decoder layers
    compiled (grouped_mm experts: one graph; not the whole model, so no Liger), gpt-oss' sink
    attention through SDPA, fused AdamW, fused LoRA, no gradient checkpointing (the planner: a
    tiny model fits), no frame past Dynamo's recompile limit, and the model still learns."""
    missing = importable("trl", ("trl", "datasets", "peft"), tmp_path)
    assert missing is None, missing
    r, _ = run_recipe("trl_sft_lora_ddp", tmp_path, "--lora-dropout", "0", "-x", "save=false")
    speed = {k: v["value"] for k, v in r["speed"].items()}
    assert speed["compile_layers"] is True and speed["torch_compile"] is False, r["speed"]
    assert speed["use_liger_kernel"] is False and speed["experts_implementation"] == "grouped_mm"
    assert speed["attn_implementation"] == "gpulaunch_sinks"
    assert speed["optim"] == "adamw_torch_fused" and speed["gradient_checkpointing"] is False
    assert speed["recompile_limit_hits"] == [], speed
    assert r["fused_lora"]["fused"] > 0 and r["compiled_layers"]["layer"] == "GptOssDecoderLayer"
    # TRL asks for the router logits (aux loss): their hooks inside the layers are traced
    assert r["compiled_layers"]["output_capture"] == "traced", r["compiled_layers"]
    check_measured(r)


def test_zero3_runs_the_tuned_config_on_gpu(tmp_path):
    missing = importable("trl", ("trl", "datasets", "deepspeed"), tmp_path)
    assert missing is None, missing
    r, _ = run_recipe("trl_sft_full_zero3", tmp_path, "-x", "save=false")
    z = r["deepspeed_zero"]
    assert z["overlap_comm"] is True and z["reduce_bucket_size"] == 500_000_000
    assert z["stage3_param_persistence_threshold"] > 0 and z["stage3_prefetch_bucket_size"] >= 5e7
    check_measured(r)


FUSED_ON_CUDA = r"""
import copy, torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
from gpulaunch.hf import fuse_lora
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
ref = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                      target_modules="all-linear", task_type="CAUSAL_LM"))
with torch.no_grad():
    for n, p in ref.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.05)
x = torch.randint(0, 512, (2, 256), device="cuda")
for mode in ("merged", "split"):
    fast = copy.deepcopy(ref)
    assert fuse_lora(fast, mode=mode)["fused"] == 14
    outs = []
    for m in (ref, torch.compile(fast)):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=x, labels=x)
        out.loss.backward()
        outs.append((out.logits.float(), {n.replace("_orig_mod.", ""): p.grad.float()
                                          for n, p in m.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = outs
    assert (la - lb).abs().max() < 0.1, (mode, (la - lb).abs().max())
    for n, g in ga.items():
        cos = torch.nn.functional.cosine_similarity(g.flatten(), gb[n].flatten(), dim=0)
        assert cos > 0.99, (mode, n, float(cos))
print("ok")
"""


def test_fused_lora_compiled_on_cuda_matches_peft(tmp_path):
    """bf16 on the GPU, inductor-compiled fused forward (both forms) against eager peft."""
    p = subprocess.run([sys.executable, "-c", FUSED_ON_CUDA], env=env_for("trl", tmp_path),
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0 and "ok" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]

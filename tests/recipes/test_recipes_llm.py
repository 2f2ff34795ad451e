"""LLM fine-tuning recipes (recipes/trl_*.py and friends), run for real: 2 CPU ranks over gloo,
the tiny model shapes, the shipped tokenizer and chat data, launched by gpulaunch exactly as a
user runs them (``python recipes/<name>.py ...``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PY, ROOT, python_env

RECIPES = ROOT / "recipes"
sys.path.insert(0, str(RECIPES))

pytest.importorskip("trl")
pytest.importorskip("peft")


def _env(tmp_path, **extra) -> dict:
    env = python_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                      "TOKENIZERS_PARALLELISM": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                      "HF_HOME": str(tmp_path / "hf-home"), "TMPDIR": str(tmp_path),
                      "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(RECIPES)]),
                      **extra})
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def run_recipe(name: str, tmp_path, *args, timeout=900, env_extra=None, check=True):
    results = tmp_path / f"{name}.json"
    cmd = [PY, str(RECIPES / f"{name}.py"), "--results", str(results), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, **(env_extra or {})),
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        return json.loads(results.read_text()), proc
    return None, proc


# ------------------------------------------------------------------ shipped assets, data loading
def test_shipped_chat_data_is_what_the_generator_writes():
    from llm_common import chat_data
    for path, rows in ((chat_data.TRAIN_FILE, chat_data.generate(
            chat_data.N_TRAIN, held_out=False, seed=chat_data.GENERATOR_SEED)),
            (chat_data.EVAL_FILE, chat_data.generate(
                chat_data.N_EVAL, held_out=True, seed=chat_data.GENERATOR_SEED + 1))):
        shipped = [json.loads(line) for line in path.read_text().splitlines()]
        assert shipped == rows, f"{path.name} differs from the generator: regenerate it"
    train_q = {r["messages"][0]["content"] for r in chat_data.generate(
        chat_data.N_TRAIN, held_out=False, seed=chat_data.GENERATOR_SEED)}
    eval_rows = [json.loads(line) for line in chat_data.EVAL_FILE.read_text().splitlines()]
    # eval questions never seen in training, except the closed-set facts (capitals, colours)
    leaked = [r for r in eval_rows if r["messages"][0]["content"] in train_q
              and not r["messages"][0]["content"].startswith(("What is the capital", "What color"))]
    assert not leaked, leaked[:3]


def test_shipped_tokenizer_retrains_identically_and_has_a_chat_template(tmp_path):
    from llm_common import chat_tokenizer
    chat_tokenizer.train_and_save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text()) == json.loads(
        (chat_tokenizer.TOKENIZER_DIR / "tokenizer.json").read_text())
    tok = chat_tokenizer.load_tokenizer()
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"},
                                   {"role": "assistant", "content": "2 plus 3 is 5."}],
                                  return_dict=True, return_assistant_tokens_mask=True)
    answer = [t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(answer) == "2 plus 3 is 5.<|end|>"   # loss on the answer only
    assert tok.decode(tok("Repeat after me: blue cat")["input_ids"]) == "Repeat after me: blue cat"


def test_user_data_must_be_chat_format(tmp_path):
    from llm_common import chat_data
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    with pytest.raises(ValueError, match="'messages' column"):
        chat_data.load_chat_datasets(str(bad))
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = chat_data.generate(20, held_out=False, seed=1)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    train, evaluation = chat_data.load_chat_datasets(str(tmp_path / "chat.parquet"))
    assert len(train) + len(evaluation) == 20 and len(evaluation) >= 1
    assert train[0]["messages"][1]["role"] == "assistant"


def test_architectures_have_the_published_sizes():
    import torch
    from llm_common import architectures, chat_tokenizer
    from transformers import AutoModelForCausalLM
    tok = chat_tokenizer.load_tokenizer()
    expected_billions = {"llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03,
                         "olmo-3-7b": 7.30, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8}
    for name, billions in expected_billions.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                architectures.build_config(name, full=True, tokenizer=tok))
        got = architectures.count_parameters(model) / 1e9
        assert abs(got - billions) / billions < 0.01, (name, got)


# ------------------------------------------------------------------ FSDP on CPU: refuse, loudly
def test_fsdp_recipe_refuses_on_cpu_before_starting_anything(tmp_path, gpulaunch_home):
    _, proc = run_recipe("trl_sft_lora_fsdp", tmp_path, timeout=120, check=False)
    assert proc.returncode != 0
    assert "FSDPNeedsGPU" in proc.stderr
    assert "silently replaces FSDP with DDP" in proc.stderr and "-x on_cpu=ddp" in proc.stderr
    assert not (gpulaunch_home / "runs").exists() or not any((gpulaunch_home / "runs").iterdir())


def test_hf_trainer_on_cpu_drops_fsdp_and_the_check_catches_it(tmp_path):
    """The premise of the refusal, shown on the real Trainer: FSDP asked, not enabled."""
    code = f"""
import sys; sys.path.insert(0, {str(RECIPES)!r})
import torch
from trl import SFTTrainer
from llm_common import architectures, chat_data, chat_tokenizer, options, sft
opts = options.RecipeOptions(recipe="t", arch="llama-3.2-1b", max_steps=1, seq_len=64,
                             batch_size=2, report_to="none")
tok = chat_tokenizer.load_tokenizer()
train, ev = chat_data.load_chat_datasets()
cfg = sft.sft_config(opts, technique=sft.FSDP2, output_dir={str(tmp_path / 'o')!r},
                     device=torch.device("cpu"), prec="fp32", decoder_layer="LlamaDecoderLayer",
                     assistant_only_loss=True)
assert cfg.fsdp, cfg.fsdp   # the config does ask for FSDP
model = architectures.load_model(arch_name="llama-3.2-1b", model_path=None, full=False,
                                 tokenizer=tok, dtype=torch.float32, seed=0)
trainer = SFTTrainer(model=model, args=cfg, train_dataset=train.select(range(8)),
                     eval_dataset=ev.select(range(4)), processing_class=tok)
print("IS_FSDP_ENABLED", trainer.is_fsdp_enabled, "IN_EFFECT", sft.technique_in_effect(trainer))
try:
    sft.require(trainer, sft.FSDP2)
except sft.TechniqueNotInEffect as e:
    print("REFUSED", e)
"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a one-rank torchrun environment: the Trainer refuses FSDP outside distributed training
    env = _env(tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "IS_FSDP_ENABLED False" in proc.stdout
    assert "REFUSED Asked the HF Trainer for fsdp2 but it is running ddp" in proc.stdout


# ------------------------------------------------------------------ the TRL recipes, 2 ranks
@pytest.mark.slow
def test_trl_lora_ddp_learns_saves_to_a_url_reloads_and_logs_to_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    out = tmp_path / "adapter"
    db = tmp_path / "mlflow.db"
    r, proc = run_recipe("trl_sft_lora_ddp", tmp_path, "--output", f"file://{out}",
                         env_extra={"MLFLOW_TRACKING_URI": f"sqlite:///{db}",
                                    "MLFLOW_EXPERIMENT_NAME": "recipes-test"})
    assert r["technique"] == "ddp" and r["wrapper"] == "ddp" and r["world_size"] == 2
    assert r["eval_loss_after"] < 0.8 * r["eval_loss_before"], r["eval_losses"]
    assert 0 < r["trainable_parameters"] < r["parameters"]
    # an adapter, plus the random base it needs, written through fsspec
    assert (out / "adapter_model.safetensors").stat().st_size > 0
    assert (out / "base_model" / "model.safetensors").exists()
    assert "reloaded file://" in proc.stdout and "generated:" in proc.stdout
    # the user's way back: from_pretrained, then generate
    from llm_common import outputs
    model, tok = outputs.load_trained(str(out))
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert isinstance(outputs.generate(model, tok, "What is 3 plus 4?", max_new_tokens=4), str)
    # HF's MLflowCallback logged the run into the tracking URI it found in the environment
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("recipes-test")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r_.info.run_id for r_ in runs]   # rank 0 only
    history = client.get_metric_history(runs[0].info.run_id, "eval_loss")
    assert len(history) >= 2 and history[-1].value < history[0].value


@pytest.mark.slow
def test_trl_qlora_trains_a_4bit_base_on_cpu_saves_and_reloads(tmp_path):
    """--load-in-4bit for real on CPU (bitsandbytes 0.50.2 quantizes there): every decoder
    linear a bitsandbytes Linear4bit, counted in the result; the adapter learns, and loads back
    onto the saved (unquantized) random base."""
    bnb = pytest.importorskip("bitsandbytes")
    where = str(Path(bnb.__file__).resolve().parents[1])   # its site dir, for the ranks too
    r, proc = run_recipe("trl_sft_lora_ddp", tmp_path, "--load-in-4bit", "--arch", "olmo-3-7b",
                         "--gpus", "1", "--max-steps", "24", "--eval-steps", "24",
                         "--eval-batches", "4", "--output", str(tmp_path / "out"),
                         env_extra={"GPULAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH":
                                    os.pathsep.join([str(ROOT / "src"), str(RECIPES), where])})
    assert r["load_in_4bit"] is True and r["technique"] == "ddp"
    q = r["quantization"]
    assert q["linear4bit_modules"] == 4 * 7          # tiny OLMo-3: 4 layers x 7 projections
    assert (q["quant_type"], q["double_quant"], q["compute_dtype"]) == ("nf4", True, "float32")
    assert r["fused_lora"] is None and r["speed"]["fuse_lora"]["value"] is False
    # parameters as defined (a 4-bit weight's numel is half its matrix): above the trainable
    assert r["parameters"] == q["parameters"] > r["trainable_parameters"] > 0
    assert r["eval_loss_after"] < 0.85 * r["eval_loss_before"], r["eval_losses"]
    assert (tmp_path / "out" / "base_model" / "model.safetensors").exists()
    assert "generated:" in proc.stdout


PARITY_ARGS = ("--max-steps", "40", "--eval-steps", "20")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    # two -x ds. overrides ride along: they must reach the dict DeepSpeed runs with
    r, proc = run_recipe("trl_sft_full_zero3", tmp, "--output", str(tmp / "model"), *PARITY_ARGS,
                         "-x", "ds.timers.throughput.enabled=true",
                         "-x", "ds.zero_optimization.reduce_bucket_size=300000000",
                         env_extra={"GPULAUNCH_HOME": str(tmp / "home"),
                                    "GPULAUNCH_FORCE_CPU": "1"})
    return r, proc, tmp / "model"


@pytest.mark.slow
def test_trl_full_zero3_exports_the_full_weights_and_reloads(zero3_run):
    pytest.importorskip("deepspeed")
    r, proc, out = zero3_run
    assert r["technique"] == "zero3" and r["wrapper"] == "deepspeed" and r["world_size"] == 2
    zero = r["deepspeed_zero"]
    assert zero["throughput_timer"] is True and zero["reduce_bucket_size"] == 300_000_000
    assert r["deepspeed_overrides"] == {"timers": {"throughput": {"enabled": True}},
                                        "zero_optimization": {"reduce_bucket_size": 300_000_000}}
    assert r["eval_loss_after"] < 0.8 * r["eval_loss_before"], r["eval_losses"]
    check = r["export_check"]
    assert check["ok"] and check["max_abs_diff"] == 0.0 and not check["empty"], check
    # independently of the recipe: every saved tensor is whole, and they add up to the model
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    saved = load_file(str(out / "model.safetensors"))
    assert all(t.numel() > 0 for t in saved.values())
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in saved.values()) == n_params == r["parameters"]
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    from llm_common import outputs
    tok = outputs.load_trained(str(out))[1]
    assert isinstance(outputs.generate(model, tok, "Count from 3 to 6.", max_new_tokens=6), str)


@pytest.mark.slow
def test_ddp_and_zero3_full_fine_tunes_agree(zero3_run, tmp_path):
    """Same data, seed and fp32 model: DDP and ZeRO-3 must give the same losses (to 1e-3 rel.:
    only the order of floating-point reductions differs)."""
    z3 = zero3_run[0]
    ddp, _ = run_recipe("trl_sft_full_zero3", tmp_path, "-x", "technique=ddp", *PARITY_ARGS,
                        "--output", str(tmp_path / "model"))
    assert ddp["technique"] == "ddp" and ddp["wrapper"] == "ddp"
    print("eval losses, DDP:", ddp["eval_losses"], "ZeRO-3:", z3["eval_losses"])
    for (step_a, a), (step_b, b) in zip(ddp["eval_losses"], z3["eval_losses"]):
        assert step_a == step_b
        assert abs(a - b) <= 1e-3 * abs(b), (ddp["eval_losses"], z3["eval_losses"])


# ------------------------------------------------------------------ launch contract, notebooks
def test_torchrun_environment_covers_what_the_frameworks_read(tmp_path):
    """HF Trainer (TRL, Unsloth, Axolotl) reads LOCAL_RANK/WORLD_SIZE; Composer's dist (LLM
    Foundry) also NODE_RANK and LOCAL_WORLD_SIZE, which torchrun itself omits; Unsloth's DDP
    placement is device_map={"": LOCAL_RANK}."""
    from gpulaunch import distributed

    @distributed(gpus=2, timeout=300)
    def probe(out):
        import os

        from transformers import TrainingArguments
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none")
        composer_reads = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT")
        return {"env": {k: os.environ.get(k) for k in composer_reads},
                "hf": (args.process_index, args.local_process_index, args.world_size,
                       str(args.parallel_mode))}

    results = probe.distributed(str(tmp_path / "o"))
    for rank, r in enumerate(results):
        env = r["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"]) == (str(rank), str(rank), "0")
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert r["hf"][:3] == (rank, rank, 2) and "DISTRIBUTED" in r["hf"][3]


LLM_RECIPES = ["trl_sft_lora_ddp", "trl_sft_lora_fsdp", "trl_sft_full_zero3",
               "unsloth_sft_lora_ddp", "axolotl_qlora_ddp", "llmfoundry_fsdp"]


@pytest.mark.parametrize("name", LLM_RECIPES)
def test_recipe_notebook_matches_its_script(name):
    jupytext = pytest.importorskip("jupytext")
    script = jupytext.read(RECIPES / f"{name}.py")
    notebook = jupytext.read(RECIPES / f"{name}.ipynb")
    assert [(c.cell_type, c.source) for c in script.cells] == \
        [(c.cell_type, c.source) for c in notebook.cells], f"run: jupytext --sync recipes/{name}.py"


def test_missing_frameworks_fail_before_launching(tmp_path, gpulaunch_home):
    """LLM Foundry cannot be installed beside torch>=2.7.1; the recipe must say so, not hang."""
    import importlib.util
    if importlib.util.find_spec("llmfoundry") is not None:
        pytest.skip("llm-foundry is installed here")
    _, proc = run_recipe("llmfoundry_fsdp", tmp_path, timeout=120, check=False)
    assert proc.returncode != 0 and "torch<2.7.1" in proc.stderr
    assert not (gpulaunch_home / "runs").exists()


# ------------------------------------------------------------------ Unsloth, Axolotl: own venvs
def _recipe_python(name: str) -> Path | None:
    """The recipe environment built by scripts/recipe_venv.sh, if it exists (never built here)."""
    for root in (os.environ.get("GPULAUNCH_RECIPE_VENVS"), Path.home() / ".cache/gpulaunch/venvs",
                 "/work/venvs"):
        if root and (Path(root) / name / "bin" / "python").exists():
            return Path(root) / name / "bin" / "python"
    return None


@pytest.mark.slow
def test_unsloth_lora_ddp_two_ranks(tmp_path):
    py = _recipe_python("unsloth")
    if py is None:
        pytest.skip("no Unsloth environment (build it: scripts/recipe_venv.sh unsloth)")
    results = tmp_path / "r.json"
    proc = subprocess.run([str(py), str(RECIPES / "unsloth_sft_lora_ddp.py"), "--results",
                           str(results), "--output", str(tmp_path / "out")], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(results.read_text())
    assert r["technique"] == "ddp" and r["wrapper"] == "ddp" and r["world_size"] == 2
    assert r["eval_loss_after"] < 0.8 * r["eval_loss_before"], r["eval_losses"]
    assert (tmp_path / "out" / "adapter_model.safetensors").exists() and "generated:" in proc.stdout
    assert r["steady_tokens_per_second"] > 0 and r["time_split"]["steps_s"] > 0


@pytest.mark.slow
def test_axolotl_lora_one_rank_on_cpu(tmp_path):
    py = _recipe_python("axolotl")
    if py is None:
        pytest.skip("no Axolotl environment (build it: scripts/recipe_venv.sh axolotl)")
    results = tmp_path / "r.json"
    proc = subprocess.run([str(py), str(RECIPES / "axolotl_qlora_ddp.py"), "--results",
                           str(results), "--output", str(tmp_path / "out")], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(results.read_text())
    assert r["world_size"] == 1 and r["adapter"] == "lora"   # CPU: one process, no 4-bit
    assert r["eval_loss_after"] < 0.8 * r["eval_loss_before"], r["eval_losses"]
    # the probe Axolotl's plugin hook put in its trainer: real tokens per step, all steps timed
    assert len(r["step_tokens"]) == r["steps"] and all(t > 0 for t in r["step_tokens"])
    assert r["steady_tokens_per_second"] > 0 and r["time_split"]["startup_s"] > 0


@pytest.mark.slow
def test_llmfoundry_fsdp_two_cpu_ranks_saves_and_reloads(tmp_path):
    """LLM Foundry in its own environment (torch 2.7.0): 2 gloo ranks, FSDP2 through Composer
    (its FSDP1 wrap needs CUDA), long chats; the HF checkpoint equals the trained weights and
    reloads with from_pretrained."""
    py = _recipe_python("llmfoundry")
    if py is None:
        pytest.skip("no LLM Foundry environment (build it: scripts/recipe_venv.sh llmfoundry)")
    results = tmp_path / "r.json"
    proc = subprocess.run([str(py), str(RECIPES / "llmfoundry_fsdp.py"), "--results",
                           str(results), "--output", str(tmp_path / "out"), "--data", "long",
                           "--seq-len", "256", "--batch-size", "2", "--max-steps", "8",
                           "--eval-steps", "8", "--measure-after", "1", "--eval-batches", "1",
                           "-x", "global_batch=4", "-x", "peak_tflops=1"], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(results.read_text())
    assert r["technique"] == r["wrapper"] == "fsdp2" and r["world_size"] == 2
    assert r["framework"].startswith("llm-foundry 0.22.0")
    assert r["eval_loss_after"] < r["eval_loss_before"], r["eval_losses"]
    check = r["export_check"]
    assert check["ok"] and check["max_abs_diff"] == 0.0 and check["tensors_compared"] > 0, check
    assert f"reloaded {tmp_path / 'out'}" in proc.stdout and "generated:" in proc.stdout
    assert r["steps"] == 8 and r["fill"] > 0.85 and r["mfu"] > 0

"""Planner arithmetic on configurations that can be computed by hand, and its choices."""
import json
import subprocess
import sys

import pytest

from gpulaunch.planner import CATALOG, ModelShape, NothingFitsError, choose_strategy, plan
from gpulaunch.planner import activations as act
from gpulaunch.planner.command import run as cli_run
from gpulaunch.planner.memory import ALLOC_WORKSPACE, Technique, estimate
from gpulaunch.planner.training_setup import TrainingSetup

GiB = 1 << 30


@pytest.mark.unit
@pytest.mark.parametrize("name,published,tol", [
    ("llama-3.2-1b", 1.236e9, 0.002), ("llama-3.2-3b", 3.21e9, 0.003), ("llama-3.1-8b", 8.03e9, 0.002),
    ("gpt-oss-20b", 20.9e9, 0.003), ("gpt-oss-120b", 116.8e9, 0.002), ("olmo-3-7b", 7.3e9, 0.01),
    ("recipe-transformer-classifier", 12.9e6, 0.01), ("recipe-mlp", 4929, 0),
])
def test_catalog_matches_published_parameter_counts(name, published, tol):
    assert abs(CATALOG[name].total_params - published) <= tol * published


@pytest.mark.unit
def test_moe_active_parameters_match_published():
    assert abs(CATALOG["gpt-oss-20b"].active_params - 3.6e9) < 0.02 * 3.6e9
    assert abs(CATALOG["gpt-oss-120b"].active_params - 5.1e9) < 0.02 * 5.1e9


@pytest.mark.unit
def test_ddp_fp32_mlp_by_hand():
    # 4929 params, fp32, AdamW foreach: params 4P, grads 4P, m+v 8P, DDP buckets 4P; the optimizer step
    # holds all of it plus one P-sized foreach temporary: 24P + workspace. No activations modelled.
    P = 4929
    e = plan("recipe-mlp", precision="fp32", gpu="A10", strategies=["ddp"]).estimate("ddp")
    assert (e.parameters, e.gradients, e.optimizer) == (4 * P, 4 * P, 8 * P)
    assert e.peak_phase == "optimizer step"
    assert e.peak_allocated == 24 * P + ALLOC_WORKSPACE


@pytest.mark.unit
def test_fused_optimizer_has_no_step_temporary():
    P = 4929
    e = plan("recipe-mlp", precision="fp32", optimizer_impl="fused", gpu="A10", strategies=["ddp"]).estimate("ddp")
    assert e.peak_allocated == 20 * P + ALLOC_WORKSPACE


@pytest.mark.unit
def test_zero3_model_states_shard_over_gpus():
    shape = CATALOG["llama-3.1-8b"]
    P = shape.total_params
    setup = TrainingSetup(micro_batch_size=1, seq_len=2048)
    m = estimate(shape, setup, Technique("zero3"), 8)
    assert m.parameters == 2 * P // 8                  # bf16 partition
    assert m.optimizer == 4 * P // 8 + 8 * P // 8      # fp32 master + Adam m, v
    assert m.gradients == 2 * P // 8
    m1 = estimate(shape, setup, Technique("zero1"), 8)
    assert m1.parameters == 2 * P and m1.gradients == 2 * P  # stage 1 shards only optimizer state



@pytest.mark.unit
@pytest.mark.parametrize("precision,c", [("bf16", 2), ("fp32", 4)])
def test_zero1_optimizer_step_by_hand(precision, c):
    # DeepSpeed ZeRO-1, world size 1, 4929-parameter MLP (no activations modelled). At the step it holds
    # params (c P) + fp32 master and Adam m, v (12P; fp32 runs need no separate master: 8P) + its gradients
    # (c P), and flattens the gradient partition (c P) and converts it to fp32 (4P; no copy when the
    # gradients already are fp32). Traced on an H200 for the 1B model: +2P flat, +4P fp32 at the peak.
    P = 4929
    e = plan("recipe-mlp", precision=precision, gpu="A10", strategies=["zero1"]).estimate("zero1")
    master = 4 * P if c == 2 else 0
    flat_and_fp32 = c * P + 4 * P if c == 2 else 4 * P
    assert e.optimizer == master + 8 * P
    assert e.phases["optimizer step"] == c * P + master + 8 * P + c * P + flat_and_fp32 + ALLOC_WORKSPACE


@pytest.mark.unit
def test_pure_bf16_block_activation_by_hand():
    # 16h + 4q + 4kv + 8i + 4*heads bytes per token: two RMSNorms (fp32 upcast + normalized + output),
    # rotated q/k, v and SDPA output, fp32 log-sum-exp, four SwiGLU intermediates.
    s = ModelShape("t", vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=48,
                   intermediate_size=688)
    setup = TrainingSetup(micro_batch_size=2, seq_len=64, precision="bf16-pure")
    p = act.profile(s, setup, act.PURE, 2)
    assert p.per_layer == (16 * 256 + 4 * 384 + 4 * 96 + 8 * 688 + 4 * 8) * 128
    assert p.loss_backward == 12 * 128 * 1000
    ck = act.profile(s, TrainingSetup(micro_batch_size=2, seq_len=64, precision="bf16-pure",
                                      activation_checkpointing=True), act.PURE, 2)
    assert ck.saved < p.saved and ck.recompute == p.per_layer


@pytest.mark.unit
def test_recommendation_moves_from_ddp_to_sharding_as_model_grows():
    kw = dict(micro_batch_size=1, seq_len=2048, gpu="H100", gpus_per_node=8, activation_checkpointing=True)
    small = plan("llama-3.2-1b", **kw)
    big = plan("llama-3.1-8b", **kw)
    assert small.recommended == "ddp" and small.estimate("ddp").fits
    assert not big.estimate("ddp").fits
    assert big.recommended in ("fsdp", "zero1", "zero2", "zero3") and not big.recommended_offload


@pytest.mark.unit
def test_offload_only_when_nothing_else_fits():
    p = plan("llama-3.1-8b", micro_batch_size=1, seq_len=2048, gpu="A100-80GB", gpus_per_node=1,
             activation_checkpointing=True)
    assert not any(e.fits for e in p.estimates if not e.offload)
    assert p.recommended_offload


@pytest.mark.unit
def test_nothing_fits_raises_with_a_fix():
    with pytest.raises(NothingFitsError, match="activation_checkpointing"):
        choose_strategy("gpt-oss-120b", micro_batch_size=8, seq_len=8192, gpu="A10", gpus_per_node=1)


@pytest.mark.unit
def test_lora_needs_far_less_than_full_finetune():
    kw = dict(micro_batch_size=1, seq_len=2048, gpu="H100", gpus_per_node=1, strategies=["ddp"])
    full = plan("llama-3.1-8b", **kw).estimate("ddp")
    lora = plan("llama-3.1-8b", lora_rank=16, **kw).estimate("ddp")
    assert lora.peak_allocated < full.peak_allocated / 3 and lora.fits and not full.fits


@pytest.mark.unit
def test_hf_config_file_equals_catalog(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
           "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = plan(str(tmp_path), gpu="H100", gpus_per_node=2)
    b = plan("llama-3.2-1b", gpu="H100", gpus_per_node=2)
    assert a.model.total_params == b.model.total_params
    assert [e.peak_allocated for e in a.estimates] == [e.peak_allocated for e in b.estimates]


@pytest.mark.unit
def test_meta_module_counts_exactly():
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    p = plan(m, gpu="A10")
    assert p.model.total_params == 4929 and p.model.family == "generic"
    assert p.recommended == "ddp"


def test_import_does_not_import_torch():
    code = "import sys, gpulaunch.planner as p; p.plan('llama-3.2-1b', gpu='H100'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,match", [
    (dict(micro_batch_size=0), "micro_batch_size"), (dict(precision="int3"), "precision"),
    (dict(gpu="Z9000"), "unknown GPU"), (dict(strategies=["zero4"]), "unknown strategy"),
    (dict(lora_rank=0), "lora_rank"),
])
def test_bad_input_names_the_fix(kwargs, match):
    kw = {"gpu": "H100", **kwargs}
    with pytest.raises(ValueError, match=match):
        plan("llama-3.2-1b", **kw)


@pytest.mark.unit
def test_cli_table_and_json(capsys):
    assert cli_run(["plan", "llama-3.2-1b", "--gpu", "H100", "--gpus-per-node", "8", "-b", "2"]) == 0
    out = capsys.readouterr().out
    assert "recommended: ddp" in out and "zero3+offload" in out
    assert cli_run(["plan", "llama-3.2-1b", "--gpu", "H100", "--json", "--no-offload"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["recommended"] == "ddp" and len(d["estimates"]) == 5
    assert cli_run(["plan", "no-such-model", "--gpu", "H100"]) == 2


@pytest.mark.unit
def test_plan_str_and_dict_round_trip():
    p = plan("gpt-oss-20b", gpu="H200", gpus_per_node=8, lora_rank=8)
    assert "gpt-oss-20b" in str(p) and "MoE" in str(p)
    json.dumps(p.to_dict())

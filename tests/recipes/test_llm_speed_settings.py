"""The speed settings of the LLM recipes, as choices (never as timings): the ZeRO-3 keys that
made the seed's DeepSpeed dict slower than DeepSpeed's defaults, and gpulaunch.hf.speed_settings'
decisions on CPU and (with the GPU facts given) on a GPU."""
from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "recipes"))
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from gpulaunch.hf import speed_settings  # noqa: E402
from gpulaunch.parallel.zero import deepspeed_config, zero_speed_settings  # noqa: E402

pytestmark = pytest.mark.unit

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                tie_word_embeddings=True)
BLOCK_1B = 2048 * 64 * (2 * 32 + 2 * 8) + 3 * 2048 * 8192 + 2 * 2048     # 60.8 M


# ------------------------------------------------------------------ ZeRO config
def test_zero3_keys_are_pinned_to_deepspeeds_defaults_or_better():
    z = deepspeed_config(3, mixed_precision="bf16", block_numel=BLOCK_1B)["zero_optimization"]
    assert z["stage"] == 3
    assert z["overlap_comm"] is True and z["contiguous_gradients"] is True
    assert z["reduce_bucket_size"] == 500_000_000
    # at least DeepSpeed's 5e7, and the next whole decoder layer
    assert z["stage3_prefetch_bucket_size"] >= max(50_000_000, BLOCK_1B)
    assert z["stage3_param_persistence_threshold"] == 100_000      # norms stay whole
    assert z["stage3_max_live_parameters"] == z["stage3_max_reuse_distance"] == 1_000_000_000
    assert z["stage3_gather_16bit_weights_on_model_save"] is True
    assert not any(v == "auto" for v in z.values())


def test_zero_settings_on_cpu_and_for_other_stages():
    assert deepspeed_config(3, on_gpu=False)["zero_optimization"]["overlap_comm"] is False
    z2 = deepspeed_config(2)["zero_optimization"]
    assert z2["overlap_comm"] is True and z2["reduce_bucket_size"] == 500_000_000
    assert "stage3_prefetch_bucket_size" not in z2
    assert zero_speed_settings(1) == {}
    # a user's override still wins (deep-merged last)
    z = deepspeed_config(3, overrides={"zero_optimization": {"reduce_bucket_size": 7}})
    assert z["zero_optimization"]["reduce_bucket_size"] == 7


def _filled_by_hf(ds: dict) -> dict:
    """The zero_optimization section after the HF Trainer fills its "auto" values for a 1B model
    (transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize, as TRL's SFTTrainer runs it)."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    class Model:
        config = LlamaConfig(**LLAMA_1B)

    hf = HfTrainerDeepSpeedConfig(ds)
    args = TrainingArguments(output_dir="/tmp/unused", use_cpu=True, report_to="none")
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, Model(), num_training_steps=10)
    return hf.config["zero_optimization"]


def test_the_seed_dict_was_slow_and_the_tuned_one_is_not():
    """Why the seed's ZeRO-3 dict lost to DeepSpeed's defaults: HF fills its "auto" buckets from
    hidden_size (4.2 M / 3.8 M elements for 1B: the prefetch bucket is smaller than one MLP
    weight) and its persistence threshold 0 partitions every norm weight."""
    from llm_common import sft
    seed = _filled_by_hf(sft.deepspeed_zero3(bf16=False))
    assert seed["reduce_bucket_size"] == 2048 * 2048
    assert seed["stage3_prefetch_bucket_size"] == int(0.9 * 2048 * 2048) < 2048 * 8192
    assert seed["stage3_param_persistence_threshold"] == 0
    block = sft.decoder_block_numel(LlamaConfig(**LLAMA_1B))
    assert block == BLOCK_1B
    tuned = _filled_by_hf(sft.deepspeed_zero3(bf16=False, tuned=True, block_numel=block,
                                              hidden_size=2048))
    assert tuned["reduce_bucket_size"] == 500_000_000
    assert tuned["stage3_prefetch_bucket_size"] >= BLOCK_1B
    # norm weights (2048) stay whole, the smallest matrix (k_proj, 1 M) is partitioned
    assert 2048 < tuned["stage3_param_persistence_threshold"] == 20480 < 2048 * 512
    assert tuned["overlap_comm"] is True
    assert tuned["stage3_gather_16bit_weights_on_model_save"] is True
    assert sft.decoder_block_numel({"hidden_size": 8, "num_local_experts": 4}) is None


def test_compiled_zero3_keeps_torchs_linear():
    """DeepSpeed's memory-efficient linear (its default) replaces F.linear process-wide, and
    Dynamo guards its backward per layer: compiled ZeRO-3 configs turn it off, the eager ones
    keep DeepSpeed's default, and HF's "auto" filling leaves the flag alone."""
    from llm_common import sft
    assert zero_speed_settings(3, compiled=True)["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in zero_speed_settings(3)
    assert "memory_efficient_linear" not in zero_speed_settings(2, compiled=True)
    assert deepspeed_config(3, compiled=True)["zero_optimization"]["memory_efficient_linear"] is False
    tuned = _filled_by_hf(sft.deepspeed_zero3(bf16=False, tuned=True, compiled=True))
    assert tuned["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in _filled_by_hf(sft.deepspeed_zero3(bf16=False, tuned=True))


def test_zero3_bf16_master_is_asked_for_and_refused_without_bf16():
    """-x master=bf16: DeepSpeed keeps master weights, gradients and AdamW state in bf16 (as the
    DDP run and the anchor train); the default keeps its fp32 copies; bad values and fp32
    training are refused with the fix in the message."""
    from llm_common import sft
    plain = sft.deepspeed_zero3(bf16=True, tuned=True)
    assert plain["bf16"] == {"enabled": True}
    bf16 = sft.deepspeed_zero3(bf16=True, tuned=True, master="bf16")
    assert bf16["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True,
                            "bf16_optimizer_states": True}
    assert bf16["zero_optimization"] == plain["zero_optimization"]
    with pytest.raises(SystemExit, match="use fp32 .* or bf16"):
        sft.deepspeed_zero3(bf16=True, master="fp16")
    with pytest.raises(SystemExit, match="needs bf16 training"):
        sft.deepspeed_zero3(bf16=False, master="bf16")


def test_deepspeed_accepts_the_bf16_master_keys():
    """The keys are DeepSpeed's own: its config model parses them (no engine, no GPU)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.precision_config import get_bfloat16_config
    from llm_common import sft
    cfg = get_bfloat16_config(sft.deepspeed_zero3(bf16=True, master="bf16"))
    assert cfg.enabled and cfg.bf16_master_weights_and_grads and cfg.bf16_optimizer_states


def test_deepspeeds_throughput_timer_is_off_when_tuned():
    """DeepSpeed's throughput timer synchronizes the device at each forward's start and step's
    end; --speed auto and prepare() turn it off, the seed's dict (--speed off) keeps it, and
    DeepSpeed's own config reader sees it off."""
    from llm_common import sft
    tuned = sft.deepspeed_zero3(bf16=True, tuned=True)
    assert tuned["timers"] == {"throughput": {"enabled": False}}
    assert "timers" not in sft.deepspeed_zero3(bf16=True)
    assert deepspeed_config(3)["timers"] == deepspeed_config(2)["timers"] == tuned["timers"]
    tuned["timers"]["throughput"]["enabled"] = True          # HF fills configs in place:
    assert deepspeed_config(3)["timers"]["throughput"]["enabled"] is False   # not shared
    pytest.importorskip("deepspeed")
    from deepspeed.utils.config import get_timers_config
    assert get_timers_config(deepspeed_config(3)).enabled is False
    assert get_timers_config(sft.deepspeed_zero3(bf16=True)).enabled is True   # its default


def test_ds_overrides_from_the_command_line():
    """-x ds.PATH=VALUE: dotted paths into the DeepSpeed dict, merged last (over --speed auto's
    keys), nothing else touched; malformed paths and non-ZeRO-3 runs are refused early."""
    from llm_common import ds_overrides, options, sft
    extra = options._parse_extra(["ds.zero_optimization.overlap_comm=false",
                                  "ds.timers.throughput.enabled=true", "master=fp32",
                                  "ds.zero_optimization.reduce_bucket_size=2e8"])
    ov = ds_overrides.from_extra(extra)
    assert ov == {"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 2e8},
                  "timers": {"throughput": {"enabled": True}}}
    tuned = sft.deepspeed_zero3(bf16=True, tuned=True)
    cfg = sft.deepspeed_zero3(bf16=True, tuned=True, overrides=ov)
    assert cfg["zero_optimization"] == {**tuned["zero_optimization"], "overlap_comm": False,
                                        "reduce_bucket_size": 2e8}
    assert cfg["timers"]["throughput"]["enabled"] is True and cfg["bf16"] == tuned["bf16"]
    assert ds_overrides.from_extra({"master": "bf16"}) == {}
    for bad in ("ds.", "ds.zero_optimization..overlap_comm", "ds.zero-optimization.x"):
        with pytest.raises(SystemExit, match="the path after 'ds.'"):
            ds_overrides.from_extra({bad: 1})
    with pytest.raises(SystemExit, match="already holds keys"):
        ds_overrides.from_extra({"ds.timers.throughput": 1, "ds.timers": 2} | {"ds.timers.x": 3})
    with pytest.raises(SystemExit, match="technique=zero3 only"):
        ds_overrides.check({"ds.timers.throughput.enabled": True}, technique="ddp")
    assert ds_overrides.check({"master": "bf16"}, technique="ddp") == {}


def test_ds_overrides_zero_keys_are_checked_by_deepspeed_in_the_parent():
    pytest.importorskip("deepspeed")
    from llm_common import ds_overrides
    ok = {"ds.zero_optimization.overlap_comm": False}
    assert ds_overrides.check(ok, technique="zero3") == {"zero_optimization": {"overlap_comm": False}}
    with pytest.raises(SystemExit, match="overlap_com.*Extra inputs are not permitted"):
        ds_overrides.check({"ds.zero_optimization.overlap_com": False}, technique="zero3")
    with pytest.raises(SystemExit, match="overlap_comm.*valid boolean"):
        ds_overrides.check({"ds.zero_optimization.overlap_comm": "maybe"}, technique="zero3")


# ------------------------------------------------------------------ speed_settings
def test_cpu_choices():
    s = speed_settings(LlamaConfig(**LLAMA_1B), device="cpu", lora_rank=8)
    a = s.trainer_args
    assert a["bf16"] is False and a["optim"] == "adamw_torch"
    assert a["torch_compile"] is False and a["use_liger_kernel"] is False
    assert s.compile_layers is False and "pad_to_multiple_of" not in a
    assert a["gradient_checkpointing"] is False and s.fuse_lora is True
    assert "Triton" in s.reasons["use_liger_kernel"]
    assert "fuse_lora" in str(s)
    with pytest.raises(ValueError, match="technique"):
        speed_settings(None, device="cpu", technique="tp")


@pytest.fixture
def as_if_gpu(monkeypatch):
    """The GPU branch of the decisions, on a CPU: bf16 reported supported, memory given."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return dict(device="cuda", gpu_memory_bytes=141 * 2**30)


def test_gpu_choices_for_lora_on_an_h200(as_if_gpu):
    s = speed_settings(LlamaConfig(**LLAMA_1B), technique="ddp", seq_len=2048,
                       micro_batch_size=4, lora_rank=8, **as_if_gpu)
    a = s.trainer_args
    assert a["bf16"] is True and a["tf32"] is True and a["optim"] == "adamw_torch_fused"
    # the decoder layers compiled, not the whole model (TRL's LM head: a new shape every batch)
    assert s.compile_layers is True and a["torch_compile"] is False
    assert "compile_layers" in s.reasons["torch_compile"] and "compile_layers" in str(s)
    assert a["pad_to_multiple_of"] == 64          # near-full rows: one shape
    # compiled: Liger's layer kernels would break the graph in every layer (recompile limit)
    assert a["use_liger_kernel"] is False and "compiled" in s.reasons["use_liger_kernel"]
    assert a["gradient_checkpointing"] is False and "planner" in s.reasons["gradient_checkpointing"]
    assert s.fuse_lora is True


def test_planner_turns_checkpointing_on_only_when_memory_needs_it(as_if_gpu):
    kw = dict(technique="ddp", seq_len=8192, micro_batch_size=16, **as_if_gpu)
    kw["gpu_memory_bytes"] = 40 * 2**30
    s = speed_settings(LlamaConfig(**LLAMA_1B), **kw)
    assert s.trainer_args["gradient_checkpointing"] is True
    assert s.trainer_args["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert "without it >" in s.reasons["gradient_checkpointing"]
    forced = speed_settings(LlamaConfig(**LLAMA_1B), gradient_checkpointing=False, **kw)
    assert forced.trainer_args["gradient_checkpointing"] is False


def test_zero3_compiles_layers_as_zero3_units_and_moe_loops_stay_eager(as_if_gpu):
    # ZeRO-3 on a GPU: the layers compile, each made one ZeRO-3 unit first (zero3_layers), so
    # DeepSpeed's hooks sit around the compiled forward (tests/recipes/test_zero3_layers.py)
    z = speed_settings(LlamaConfig(**LLAMA_1B), technique="zero3", micro_batch_size=4, **as_if_gpu)
    assert z.trainer_args["torch_compile"] is False and z.compile_layers is True
    assert z.zero3_layers is True and "ZeRO-3" in z.reasons["compile_layers"]
    assert "gathered whole" in z.reasons["zero3_layers"] and "zero3_layers" in str(z)
    assert z.trainer_args["pad_to_multiple_of"] == 64
    eager = speed_settings(LlamaConfig(**LLAMA_1B), technique="zero3", compile=False, **as_if_gpu)
    assert eager.compile_layers is False and eager.zero3_layers is False
    assert speed_settings(LlamaConfig(**LLAMA_1B), technique="ddp",
                          **as_if_gpu).zero3_layers is False
    cpu = speed_settings(LlamaConfig(**LLAMA_1B), technique="zero3", device="cpu")
    assert cpu.compile_layers is False and cpu.zero3_layers is False
    # an MoE whose experts transformers loops over (gpt-oss' grouped experts: test_gptoss_speed)
    moe = {**LLAMA_1B, "num_local_experts": 32}
    m = speed_settings(moe, gradient_checkpointing=False, **as_if_gpu)
    assert m.trainer_args["torch_compile"] is False and m.compile_layers is False
    forced = speed_settings(LlamaConfig(**LLAMA_1B), technique="zero3", compile=True,
                            device="cpu")
    assert forced.compile_layers is True and forced.trainer_args["torch_compile"] is False
    assert forced.zero3_layers is True
    whole = speed_settings(LlamaConfig(**LLAMA_1B), compile="model", **as_if_gpu)
    assert whole.trainer_args["torch_compile"] is True and whole.compile_layers is False
    packed = speed_settings(LlamaConfig(**LLAMA_1B), packed=True, **as_if_gpu)
    assert packed.compile_layers is True and "pad_to_multiple_of" not in packed.trainer_args
    with pytest.raises(ValueError, match="compile='everything'.*'model'"):
        speed_settings(LlamaConfig(**LLAMA_1B), compile="everything", **as_if_gpu)


def test_liger_only_without_compile_and_fsdp2_compiles_the_layers(as_if_gpu):
    import importlib.util
    liger = importlib.util.find_spec("liger_kernel") is not None   # the test extra installs it
    # FSDP2's hooks sit around each layer, outside its compiled forward
    f = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", lora_rank=8, **as_if_gpu)
    assert f.compile_layers is True and f.trainer_args["torch_compile"] is False
    assert f.trainer_args["use_liger_kernel"] is False
    f_eager = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", lora_rank=8,
                             compile=False, **as_if_gpu)
    assert f_eager.trainer_args["use_liger_kernel"] is liger, f_eager.reasons["use_liger_kernel"]
    eager = speed_settings(LlamaConfig(**LLAMA_1B), compile=False, **as_if_gpu)
    assert eager.trainer_args["use_liger_kernel"] is liger
    both = speed_settings(LlamaConfig(**LLAMA_1B), compile=True, liger=True, **as_if_gpu)
    assert both.trainer_args["use_liger_kernel"] is True       # asked for: still honoured
    forced = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", compile=True,
                            **as_if_gpu)
    assert forced.compile_layers is True
    assert forced.trainer_args["use_liger_kernel"] is False


# ------------------------------------------------------------------ the recipes' wrapper
def test_recipe_speed_modes():
    from llm_common import options, speed
    defaults = options.RecipeOptions(recipe="t", gradient_checkpointing=True, lora_r=8)
    cfg = LlamaConfig(**LLAMA_1B)
    off = options.parse(defaults, argv=["--speed", "off"])
    assert speed.settings(off, torch.device("cpu"), technique="ddp", config=cfg, lora=True,
                          world_size=1) is None
    assert speed.apply(off, None) == (off, None, {})
    auto = options.parse(defaults, argv=["-x", "fused_lora=false"])
    s = speed.settings(auto, torch.device("cpu"), technique="ddp", config=cfg, lora=True,
                       world_size=1)
    opts, trainer_args, _ = speed.apply(auto, s)
    assert opts.gradient_checkpointing is False        # the default gave way to the decision
    assert trainer_args["optim"] == "adamw_torch" and s.fuse_lora is False
    explicit = options.parse(defaults, argv=["--gradient-checkpointing"])
    s = speed.settings(explicit, torch.device("cpu"), technique="ddp", config=cfg, lora=True,
                       world_size=1)
    assert speed.apply(explicit, s)[0].gradient_checkpointing is True
    assert speed.summary(s)["gradient_checkpointing"]["why"] == "asked for"
    with pytest.raises(SystemExit, match="--speed"):
        speed.settings(options.parse(defaults, argv=["--speed", "max"]), torch.device("cpu"),
                       technique="ddp", config=cfg, lora=True, world_size=1)


def test_one_process_under_zero3_or_fsdp2_is_told_to_use_ddp_when_it_fits(as_if_gpu):
    z = speed_settings(LlamaConfig(**LLAMA_1B), technique="zero3", micro_batch_size=4, **as_if_gpu)
    assert len(z.notes) == 1 and "zero3 shards nothing" in z.notes[0]
    assert "technique='ddp' is the faster choice" in z.notes[0] and "note: one process" in str(z)
    # a GPU too small for DDP's full copy of weights, gradients and AdamW state: keep sharding
    small = dict(as_if_gpu, gpu_memory_bytes=8 * 2**30)
    tight = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", **small)
    assert "over this GPU), so keep fsdp2" in tight.notes[0]
    # several processes shard: no note; DDP: no note
    assert speed_settings(LlamaConfig(**LLAMA_1B), technique="zero3", world_size=8,
                          **as_if_gpu).notes == []
    assert speed_settings(LlamaConfig(**LLAMA_1B), technique="ddp", **as_if_gpu).notes == []


def test_fsdp2_on_one_process_keeps_the_gathered_layers_where_memory_allows(as_if_gpu):
    """One rank's shard is the whole weight: resharding after forward frees only the gathered
    copy and gathers every layer again in backward (prepare(strategy='fsdp') keeps them too)."""
    from llm_common import options, sft, speed
    one = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", micro_batch_size=4,
                         lora_rank=8, **as_if_gpu)
    assert one.fsdp_config == {"reshard_after_forward": False}
    assert "one process" in one.reasons["reshard_after_forward"]
    assert "reshard_after_forward" in str(one)
    # several ranks shard for real; a GPU without room for a second copy; the CPU; DDP
    eight = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", world_size=8, **as_if_gpu)
    assert eight.fsdp_config == {"reshard_after_forward": True}
    small = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", micro_batch_size=4,
                           **dict(as_if_gpu, gpu_memory_bytes=24 * 2**30))
    assert small.fsdp_config == {"reshard_after_forward": True}
    assert "less than a second copy" in small.reasons["reshard_after_forward"]
    cpu = speed_settings(LlamaConfig(**LLAMA_1B), technique="fsdp2", device="cpu")
    assert cpu.fsdp_config == {"reshard_after_forward": True}
    assert speed_settings(LlamaConfig(**LLAMA_1B), technique="ddp", **as_if_gpu).fsdp_config == {}
    # the recipes: the key reaches the SFTConfig's FSDP2 dict over the seed's True, and the
    # result records it (the GPU's other fields, tf32 say, would not build on this CPU)
    opts = options.RecipeOptions(recipe="t", arch="llama-3.2-1b", max_steps=1, seq_len=64,
                                 batch_size=2, report_to="none")
    _, over, _ = speed.apply(opts, one)
    assert over["fsdp_config"] == {"reshard_after_forward": False}
    assert speed.summary(one)["reshard_after_forward"]["value"] is False
    cfg = sft.sft_config(opts, technique=sft.FSDP2, output_dir="/tmp/unused-fsdp-cfg",
                         device=torch.device("cpu"), prec="fp32",
                         decoder_layer="LlamaDecoderLayer", assistant_only_loss=True,
                         speed_overrides={"fsdp_config": over["fsdp_config"]})
    assert cfg.fsdp_config["reshard_after_forward"] is False
    assert cfg.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    seed = sft.sft_config(opts, technique=sft.FSDP2, output_dir="/tmp/unused-fsdp-cfg",
                          device=torch.device("cpu"), prec="fp32",
                          decoder_layer="LlamaDecoderLayer", assistant_only_loss=True)
    assert seed.fsdp_config["reshard_after_forward"] is True      # --speed off: the seed's
    # DDP ignores the FSDP keys
    ddp = sft.sft_config(opts, technique=sft.DDP, output_dir="/tmp/unused-fsdp-cfg",
                         device=torch.device("cpu"), prec="fp32",
                         decoder_layer="LlamaDecoderLayer", assistant_only_loss=True,
                         speed_overrides={"fsdp_config": over["fsdp_config"]})
    assert not ddp.fsdp


def test_reshard_after_forward_can_be_forced_under_speed_auto():
    from llm_common import options, speed
    defaults = options.RecipeOptions(recipe="t", lora_r=8, batch_size=4)
    cfg = LlamaConfig(**LLAMA_1B)
    cpu = torch.device("cpu")
    auto = speed.settings(options.parse(defaults, argv=[]), cpu, technique="fsdp2", config=cfg,
                          lora=True, world_size=1)
    assert auto.fsdp_config == {"reshard_after_forward": True}     # CPU: the decision's default
    forced = speed.settings(options.parse(defaults, argv=["-x", "reshard_after_forward=false"]),
                            cpu, technique="fsdp2", config=cfg, lora=True, world_size=1)
    assert forced.fsdp_config == {"reshard_after_forward": False}
    assert speed.summary(forced)["reshard_after_forward"] == {"value": False, "why": "asked for"}
    # DDP has no FSDP dict to put it in
    ddp = speed.settings(options.parse(defaults, argv=["-x", "reshard_after_forward=false"]),
                         cpu, technique="ddp", config=cfg, lora=True, world_size=1)
    assert ddp.fsdp_config == {}
    with pytest.raises(SystemExit, match="use true or false"):
        speed.reshard_choice({"reshard_after_forward": "maybe"})
    assert speed.reshard_choice({}) is None

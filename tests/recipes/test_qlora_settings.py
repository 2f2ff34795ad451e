"""trl_sft_lora_ddp --load-in-4bit (QLoRA) as choices, no training: the BitsAndBytesConfig it
builds, the --speed auto settings over a 4-bit base (with the GPU facts given), and the early
refusals. The recipe itself trains QLoRA on CPU in test_recipes_llm.py."""
from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "recipes"))
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

pytestmark = pytest.mark.unit

OLMO3_7B = dict(model_type="olmo3", hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                vocab_size=100278, tie_word_embeddings=False)


def _opts(*argv, recipe="trl_sft_lora_ddp"):
    from llm_common import options
    return options.parse(options.RecipeOptions(recipe=recipe, lora_r=32), argv=list(argv))


def test_bnb_config_is_what_a_trl_user_writes():
    from llm_common import qlora
    q = qlora.bnb_config("bf16")
    assert q.load_in_4bit is True and q.load_in_8bit is False
    assert q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant is True
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    assert qlora.bnb_config("fp32").bnb_4bit_compute_dtype == torch.float32   # the CPU run


@pytest.fixture
def as_if_gpu(monkeypatch):
    """The GPU branch of the decisions, on a CPU (as test_llm_speed_settings does)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return torch.device("cuda")


def _settings(opts, device, quantized=True):
    """(--no-gradient-checkpointing: the bench's choice; the planner needs a real GPU's memory)"""
    from llm_common import speed
    return speed.settings(opts, device, technique="ddp", config=OLMO3_7B, lora=True,
                          world_size=1, quantized=quantized)


def test_speed_over_a_4bit_base_on_a_gpu(as_if_gpu):
    import importlib.util

    from llm_common import qlora
    liger = importlib.util.find_spec("liger_kernel") is not None   # the test extra installs it
    bf16 = _settings(_opts("--no-gradient-checkpointing"), as_if_gpu, quantized=False)
    assert bf16.compile_layers is True and bf16.fuse_lora is True   # what a bf16 base gets
    s = _settings(_opts("--load-in-4bit", "--no-gradient-checkpointing"), as_if_gpu)
    a = s.trainer_args
    # compiled layers and fused LoRA off, each with its reason
    assert s.compile_layers is False and a["torch_compile"] is False
    assert s.reasons["compile_layers"] == qlora.SPEED_WHY["compile_layers"]
    assert s.fuse_lora is False and s.reasons["fuse_lora"] == qlora.SPEED_WHY["fuse_lora"]
    assert "pad_to_multiple_of" not in a                   # only for compiled padded rows
    # Liger: an eager bf16 run would take it (olmo3 has kernels); over 4 bits unmeasured: off
    eager = _settings(_opts("--no-gradient-checkpointing", "-x", "compile=false"), as_if_gpu,
                      quantized=False)
    assert eager.trainer_args["use_liger_kernel"] is liger
    assert a["use_liger_kernel"] is False
    assert s.reasons["use_liger_kernel"] == qlora.SPEED_WHY["use_liger_kernel"]
    assert a["optim"] == "adamw_torch_fused" and a["bf16"] is True
    # what a user forces still wins
    forced = _settings(_opts("--load-in-4bit", "--no-gradient-checkpointing", "-x",
                             "compile=true", "-x", "fused_lora=true"), as_if_gpu)
    assert forced.compile_layers is True and forced.reasons["compile_layers"] == "asked for"
    assert forced.fuse_lora is True and forced.trainer_args["use_liger_kernel"] is False
    liger_on = _settings(_opts("--load-in-4bit", "--no-gradient-checkpointing", "-x",
                               "liger=true"), as_if_gpu)
    assert liger_on.trainer_args["use_liger_kernel"] is True and liger_on.compile_layers is False


def test_speed_over_a_4bit_base_on_cpu():
    s = _settings(_opts("--load-in-4bit"), torch.device("cpu"))
    assert s.compile_layers is False and "CPU" in s.reasons["compile_layers"]
    assert s.fuse_lora is False and "4-bit" in s.reasons["fuse_lora"]


def test_only_the_trl_lora_recipe_takes_load_in_4bit():
    assert _opts("--load-in-4bit").load_in_4bit is True
    assert _opts().load_in_4bit is False
    for recipe in ("trl_sft_full_zero3", "trl_sft_lora_fsdp", "axolotl_qlora_ddp"):
        with pytest.raises(SystemExit, match="--load-in-4bit is not an option of .*trl_sft_lora_ddp"):
            _opts("--load-in-4bit", recipe=recipe)
    assert _opts("--no-load-in-4bit", recipe="trl_sft_full_zero3").load_in_4bit is False


def test_refusals_name_the_fix(monkeypatch, tmp_path):
    from llm_common import qlora
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)     # as if not installed
    with pytest.raises(SystemExit, match=r"pip install 'bitsandbytes>=0\.50\.2'"):
        qlora.require_bitsandbytes()
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(SystemExit, match="already quantized .*mxfp4.*drop --load-in-4bit"):
        qlora.refuse_prequantized(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig().to_dict()))
    qlora.refuse_prequantized(str(tmp_path))                   # a bf16 checkpoint: fine
    qlora.refuse_prequantized(None)                            # a random base: fine


def test_a_lora_linear4bit_traces_in_one_graph_forward_and_backward():
    """What the compiled-layers choice over 4 bits rests on (kept off until a GPU measures its
    speed): Dynamo traces peft's LoRA over a bitsandbytes Linear4bit, in training, forward and
    backward, without a graph break (Params4bit and MatMul4Bit included)."""
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    from torch import nn

    def linear4bit(n_in, n_out):
        layer = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.float32,
                                  quant_type="nf4", compress_statistics=True)
        layer.weight = bnb.nn.Params4bit(torch.randn(n_out, n_in) * 0.05, requires_grad=False,
                                         quant_type="nf4", compress_statistics=True)
        return layer.to("cpu")            # quantizes (bitsandbytes 0.50.2 does it on CPU)

    class MLP(nn.Module):
        is_loaded_in_4bit = True          # what from_pretrained sets; peft's bnb dispatch reads it

        def __init__(self):
            super().__init__()
            self.up, self.down = linear4bit(64, 128), linear4bit(128, 64)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.up(x)))

    torch.manual_seed(0)
    model = get_peft_model(MLP(), LoraConfig(r=8, target_modules=["up", "down"])).base_model.model
    model.train()
    assert type(model.up).__module__ == "peft.tuners.lora.bnb"
    x = torch.randn(4, 64, requires_grad=True)
    explained = torch._dynamo.explain(model.forward)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    assert torch.allclose(y, model(x), atol=1e-5)
    assert model.up.lora_B["default"].weight.grad is not None and x.grad is not None
